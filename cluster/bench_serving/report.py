"""What a benchmark leaves behind: tables on stdout, results.jsonl (one line per request rate),
requests.jsonl (one line per request, on demand), and latency_vs_rate.png when matplotlib is
installed (the `bench` extra)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench_serving.datasets import DatasetSpec, DatasetStats
from cluster.bench_serving.metrics import LatencyStats, RunSummary, Slo
from cluster.bench_serving.results import RunResult, rate_to_json

RESULTS_FILE = "results.jsonl"
REQUESTS_FILE = "requests.jsonl"
PLOT_FILE = "latency_vs_rate.png"
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
ERRORS_SHOWN = 3


@dataclass(frozen=True)
class BenchSetup:
    """What every run of one invocation shares, written beside each run's numbers."""

    url: str
    model: str
    endpoint: str
    max_concurrency: int | None
    ignore_eos: bool
    temperature: float
    dataset: DatasetSpec
    dataset_stats: DatasetStats

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "endpoint": self.endpoint,
            "max_concurrency": self.max_concurrency,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "dataset": self.dataset.to_json() | self.dataset_stats.to_json(),
        }


class ResultsWriter:
    """Appends each finished run to the output folder's files, which it starts empty, so that a
    sweep interrupted halfway keeps the runs it finished."""

    def __init__(self, output_dir: Path, setup: BenchSetup, save_requests: bool) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.results_path = output_dir / RESULTS_FILE
        self.requests_path = output_dir / REQUESTS_FILE if save_requests else None
        self.setup = setup
        for path in (self.results_path, self.requests_path):
            if path is not None:
                path.write_text("")

    def write_run(self, summary: RunSummary, run: RunResult) -> None:
        with self.results_path.open("a") as results:
            results.write(json.dumps(summary.to_json() | self.setup.to_json()) + "\n")
        if self.requests_path is None:
            return
        rate = rate_to_json(run.request_rate)
        with self.requests_path.open("a") as requests:
            for result in run.results:
                line = {"request_rate": rate} | result.to_json(run.started_at)
                requests.write(json.dumps(line) + "\n")


def format_summaries(summaries: Sequence[RunSummary]) -> str:
    """The throughput table (a row per rate), the latency table (a row per rate and latency),
    and the most frequent failure reasons."""
    parts = [_throughput_table(summaries), _latency_table(summaries)]
    parts.extend(_error_lines(summary) for summary in summaries if summary.errors)
    return "\n\n".join(parts)


def _throughput_table(summaries: Sequence[RunSummary]) -> str:
    header = ["rate/s", "completed", "failed", "lost", "duration_s", "req/s", "in tok/s"]
    header += ["out tok/s", "goodput/s", "accept len", "cached %"]
    rows = [
        [
            _rate_label(s),
            str(s.completed),
            str(s.failed),
            str(s.lost),
            _number(s.duration_s),
            _number(s.request_throughput),
            _number(s.input_token_throughput, 1),
            _number(s.output_token_throughput, 1),
            _number(s.goodput),
            _number(s.spec_accept_length),
            _number(None if s.cached_share is None else 100.0 * s.cached_share, 1),
        ]
        for s in summaries
    ]
    return format_table(header, rows)


def _latency_table(summaries: Sequence[RunSummary]) -> str:
    header = ["rate/s", "latency (ms)", "mean", "p50", "p90", "p99"]
    rows = []
    for summary in summaries:
        for name in LATENCIES:
            stats: LatencyStats = getattr(summary, name)
            values = (stats.mean, stats.p50, stats.p90, stats.p99)
            label = name.removesuffix("_ms").upper()
            rows.append([_rate_label(summary), label, *(_number(v) for v in values)])
    return format_table(header, rows)


def _error_lines(summary: RunSummary) -> str:
    lines = [f"rate {_rate_label(summary)}: {summary.failed} failed, {summary.lost} lost"]
    for reason, count in list(summary.errors.items())[:ERRORS_SHOWN]:
        lines.append(f"  {count} x {reason}")
    return "\n".join(lines)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Plain aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def _rate_label(summary: RunSummary) -> str:
    label = f"{summary.request_rate:g}"
    return f"{label} (interrupted)" if summary.interrupted else label


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot_latency_vs_rate(summaries: Sequence[RunSummary], path: Path) -> bool:
    """TTFT and TPOT p50/p99 (log scale) and goodput against the request rate; False, and no
    file, when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    ordered = sorted(summaries, key=lambda summary: summary.request_rate)
    # Rates as evenly spaced categories: an infinite rate has no place on a numeric axis.
    positions = list(range(len(ordered)))
    labels = [f"{summary.request_rate:g}" for summary in ordered]
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    latency, goodput = figure.subplots(1, 2)
    for name in ("ttft_ms", "tpot_ms"):
        for percentile, style in (("p50", "-o"), ("p99", "--o")):
            values = [_or_nan(getattr(getattr(s, name), percentile)) for s in ordered]
            label = f"{name.removesuffix('_ms').upper()} {percentile}"
            latency.plot(positions, values, style, label=label)
    latency.set(title="Latency", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    goodput.plot(positions, [s.goodput for s in ordered], "-o", label="goodput")
    goodput.plot(positions, [s.request_throughput for s in ordered], ":o", label="completed")
    goodput.set(title=_goodput_title(ordered[0].slo), xlabel="request rate (req/s)", ylabel="req/s")
    for axes in (latency, goodput):
        axes.set_xticks(positions, labels)
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.savefig(path, dpi=120)
    return True


def _goodput_title(slo: Slo) -> str:
    targets = [
        f"{name} <= {target:g} ms"
        for name, target in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms))
        if target is not None
    ]
    return f"Goodput ({', '.join(targets)})" if targets else "Goodput (no SLO given)"


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
