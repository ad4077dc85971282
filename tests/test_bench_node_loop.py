"""bench/node_loop.py: a served run's node figures from /metrics counters, and the table that
puts them beside the offline engine's."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import node_loop  # noqa: E402
from cluster.control.metrics import ClusterMetrics  # noqa: E402


def _stats(engine_s: float, decode: int, tokens: int) -> dict:
    return {
        "tokens_out": tokens,
        "loop_seconds": {"waiting": 9.0, "engine": engine_s, "streams": 0.5, "other": 0.25},
        "steps": {"decode": decode, "prefill": 2, "mixed": 3, "drains": 4},
    }


def _metrics_text(stats: dict, role: str = "decode") -> str:
    async def read() -> dict:
        return stats

    node = SimpleNamespace(name=f"{role}-0", role=role, alive=True, in_flight=0, stats=read)
    return asyncio.run(ClusterMetrics([node]).render()).decode()


def test_counters_are_read_from_the_metrics_of_generating_nodes(monkeypatch):
    texts = {"decode": _metrics_text(_stats(3.0, 100, 800))}
    texts["prefill"] = _metrics_text(_stats(1.0, 0, 0), role="prefill")
    text = texts["decode"] + texts["prefill"]
    monkeypatch.setattr(node_loop.httpx, "get", lambda url, timeout: SimpleNamespace(text=text))
    counters = node_loop.node_counters("http://cluster")
    assert list(counters) == ["decode-0"]  # a prefill node generates nothing
    assert counters["decode-0"] == {
        "tokens": 800,
        "loop:waiting": 9.0,
        "loop:engine": 3.0,
        "loop:streams": 0.5,
        "loop:other": 0.25,
        "steps:decode": 100,
        "steps:prefill": 2,
        "steps:mixed": 3,
        "steps:drains": 4,
    }


def test_a_run_is_the_difference_of_the_counters_over_its_duration():
    before = {"decode-0": {"tokens": 100.0, "loop:engine": 1.0, "loop:streams": 0.1,
                           "loop:other": 0.1, "steps:decode": 10, "steps:prefill": 1}}  # fmt: skip
    after = {"decode-0": {"tokens": 900.0, "loop:engine": 3.0, "loop:streams": 0.3,
                          "loop:other": 0.2, "steps:decode": 105, "steps:prefill": 3,
                          "steps:mixed": 3, "steps:drains": 2}}  # fmt: skip
    (row,) = node_loop.node_figures(before, after, run_s=4.0)
    assert row["steps"] == {"decode": 95, "prefill": 2, "mixed": 3, "drains": 2}
    assert row["steps_per_s"] == pytest.approx(100 / 4.0)
    assert row["tokens_per_step"] == pytest.approx(800 / 100)
    assert row["ms_per_step"] == pytest.approx(2.0 / 100 * 1e3)
    assert row["share"] == pytest.approx(
        {"engine": 0.5, "streams": 0.05, "other": 0.025, "waiting": 0.425}
    )


def test_the_table_puts_the_offline_engine_beside_the_nodes():
    offline = node_loop.offline_figures(
        800, 2.0, {"decode": 99, "prefill": 1, "mixed": 0, "drains": 0}
    )
    assert offline["ms_per_step"] == pytest.approx(20.0)
    rows = [
        {"setup": "offline engine", "api_servers": 0, "concurrency": 8, "nodes": [offline]},
        {"setup": "1p1d", "api_servers": 1, "concurrency": 8, "nodes": [
            node_loop.node_figures({}, {"decode-0": {"tokens": 80.0, "loop:engine": 1.0,
                                                     "steps:decode": 10}}, 2.0)[0]]},
    ]  # fmt: skip
    lines = node_loop.loop_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| offline engine | - | 8 | - | 50 | 8.0 | 20.00 | 99 / 1 / 0 |")
    assert lines[3].startswith("| 1p1d | 1 | 8 | decode-0 | 5 | 8.0 | 100.00 | 10 / 0 / 0 | 0 |")
    assert lines[3].endswith("| 50 % | 0 % | 0 % | 50 % |")
