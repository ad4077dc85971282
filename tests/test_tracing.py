"""Per-request tracing: the offline engine's timeline (every decode step's draft, verify and
draft extend with its correct drafts), nothing recorded with tracing off, and through a 1 x 1
speculative cluster the Chrome trace per request (file, route and `usage.trace_summary`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from tiny_drafts import make_good_draft, make_predictable_llama

from cluster.control.tracing import (
    ROUTER_PID,
    NodeTimeline,
    RequestTimeline,
    chrome_trace,
    clock_offset_ns,
)
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM, SamplingParams
from engine.tracing import clock_ns

K = 3
PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40))]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ENGINE = dict(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tracing")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", K, noise=0.01)
    return root


def _llm(folders: Path, tracing: bool) -> LLM:
    return LLM(
        str(folders / "target"),
        device="cpu",
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(folders / "draft"),
        enable_tracing=tracing,
        **ENGINE,
    )


def _names(events: list[list]) -> list[str]:
    return [event[0] for event in events]


def test_offline_engine_records_every_decode_step(folders):
    outputs = _llm(folders, tracing=True).generate(PROMPTS, PARAMS)
    for out in outputs:
        names = _names(out.trace)
        times = [event[1] for event in out.trace]
        assert times == sorted(times), names
        assert names[:5] == [
            "queued",
            "prefill_start",
            "prefill_end",
            "draft_extend_start",
            "draft_extend_end",
        ]
        assert names[-1] == "finish"
        usage, details = out.usage, out.usage.completion_tokens_details
        steps = usage.spec_verify_steps
        # Draft extend: once after prefill, then after every verify step but the last (which
        # leaves at most one token to emit: nothing to draft for).
        for span, count in (("draft", steps), ("verify", steps), ("draft_extend", steps)):
            assert names.count(f"{span}_start") == names.count(f"{span}_end") == count, span
        # A last token that left no room for drafts is a plain decode step.
        assert names.count("decode_start") == names.count("decode_end") in (0, 1)
        counts = [event[2] for event in out.trace if event[0] == "correct_drafts"]
        assert len(counts) == steps
        assert sum(c["correct"] for c in counts) == details.accepted_prediction_tokens
        assert sum(c["drafts"] - c["correct"] for c in counts) == (
            details.rejected_prediction_tokens
        )
        assert all(0 <= c["correct"] <= c["drafts"] <= K for c in counts)
        # Each step in order: draft (free: the chain exists) -> verify -> draft extend.
        first = names.index("verify_start")
        assert names[first - 2 : first + 2] == [
            "draft_start",
            "draft_end",
            "verify_start",
            "verify_end",
        ]
        # Each decode step's first event names its round plan.
        firsts = [e for e in out.trace if e[0] in ("draft_start", "decode_start")]
        assert firsts and all(e[2]["plan"] for e in firsts)
    # A good draft gets some drafts right.
    correct = [e[2]["correct"] for out in outputs for e in out.trace if e[0] == "correct_drafts"]
    assert sum(correct) > 0


def test_tracing_off_records_nothing(folders):
    llm = _llm(folders, tracing=False)
    req = llm.engine.make_request("0", PROMPTS[0], PARAMS)
    assert req.trace is None
    llm.engine.add_request(req)
    while llm.engine.has_work():
        llm.engine.step()
    assert req.trace is None and llm.engine.output(req).trace is None


# --- clock alignment (no cluster) ---
def test_clock_offset_is_measured_from_the_shortest_round_trip():
    skew = 1_500_000_000
    offset = clock_offset_ns(lambda: clock_ns() - skew)
    assert abs(offset - skew) < 5_000_000


def test_a_skewed_node_clock_is_narrowed_to_causal_order():
    # The decode node's clock runs 3 ms ahead of what its measured offset says.
    router = RequestTimeline("r", [("arrival", 0)])
    router.events += [["routed", 1_000_000], ["first_token", 9_000_000], ["finish", 9_500_000]]
    decode = [["decode_received", 1_100_000 + 3_000_000], ["first_token", 8_900_000 + 3_000_000]]
    decode += [["finish", 9_000_000 + 3_000_000]]
    trace = chrome_trace(router, [NodeTimeline("decode-0", decode, 0)], {})
    by_name = {(e["pid"], e["name"]): e["ts"] for e in trace["traceEvents"] if e["ph"] == "i"}
    decode_pid = _pids(trace)["decode-0"]
    assert by_name[(decode_pid, "decode_received")] >= by_name[(ROUTER_PID, "routed")]
    assert by_name[(decode_pid, "first_token")] <= by_name[(ROUTER_PID, "first_token")]


def _pids(trace: dict) -> dict[str, int]:
    return {
        e["args"]["name"]: e["pid"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def test_traces_route_is_a_404_when_tracing_is_off():
    backend = SimpleNamespace(model_name="m", max_model_len=8, tokenizer=None)
    with TestClient(create_app(backend)) as client:
        response = client.get("/v1/traces/cmpl-123")
    assert response.status_code == 404
    assert "tracing is off" in response.json()["error"]["message"]


# --- through the cluster ---
@pytest.fixture(scope="module")
def traced_cluster(folders, tmp_path_factory):
    ray = pytest.importorskip("ray")  # noqa: F841 - the cluster needs it
    from cluster_helpers import ensure_ray

    from cluster.deploy.config import ClusterConfig
    from cluster.deploy.launcher import Cluster
    from engine.loading.loader import EngineArgs

    ensure_ray()
    trace_dir = tmp_path_factory.mktemp("traces")
    engine = EngineArgs(
        model=str(folders / "target"),
        device="cpu",
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(folders / "draft"),
        **ENGINE,
    )
    config = ClusterConfig(
        engine=engine, transfer_timeout_s=30.0, enable_tracing=True, trace_dir=str(trace_dir)
    )
    cluster = Cluster.launch(config)
    server = BackgroundServer(create_app(cluster.router)).start()
    yield server, trace_dir
    server.stop()
    cluster.shutdown()


def _spans(trace: dict, pid: int, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["pid"] == pid and e["name"] == name]


def _start(trace: dict, pid: int, name: str) -> float:
    return _spans(trace, pid, name)[0]["ts"]


def _end(trace: dict, pid: int, name: str) -> float:
    event = _spans(trace, pid, name)[0]
    return event["ts"] + event.get("dur", 0)


def test_cluster_writes_and_serves_a_chrome_trace_per_request(traced_cluster):
    server, trace_dir = traced_cluster
    reused = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        # The first prompt again last: its decode node holds it, and reuses its KV.
        for prompt in [*PROMPTS[:2], PROMPTS[0]]:
            body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            answer = answer.json()
            usage, request_id = answer["usage"], answer["id"]
            trace = json.loads((trace_dir / f"{request_id}.json").read_text())
            served = http.get(f"/v1/traces/{request_id}")
            assert served.status_code == 200 and served.json() == trace
            reused.append(_check_trace(trace, request_id, usage))
        assert http.get("/v1/traces/cmpl-unknown").status_code == 404
    assert reused[:2] == [0, 0] and reused[2] > 0, reused


def _check_trace(trace: dict, request_id: str, usage: dict) -> int:
    """Check a request's trace; returns the prompt positions its transfer left out, which its
    decode node held already."""
    pids = _pids(trace)
    assert {"router", "prefill-0", "decode-0"} <= set(pids)
    router, prefill, decode = pids["router"], pids["prefill-0"], pids["decode-0"]
    named = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] in "XiC"}
    for pid, names in (
        (router, ["arrival", "tokenized", "routed", "first_token", "finish", "request"]),
        (prefill, ["prefill_queued", "prefill", "draft_extend", "transfer"]),
        (
            decode,
            ["decode_received", "prefill_requested", "receive_posted", "receive"]
            + ["transfer_end", "decode_admitted", "first_token", "finish"]
            + ["draft", "verify", "draft_extend", "correct_drafts"],
        ),
    ):
        assert not {(pid, n) for n in names} - named, [n for n in names if (pid, n) not in named]
    for e in trace["traceEvents"]:
        if e["ph"] in "Xi":
            assert e["args"]["request_id"] == request_id, e
    order = [
        _start(trace, router, "arrival"),
        _start(trace, prefill, "prefill"),
        _end(trace, prefill, "prefill"),
        _start(trace, prefill, "transfer"),
        _end(trace, prefill, "transfer"),
        _start(trace, decode, "first_token"),
        _start(trace, router, "first_token"),
        _start(trace, decode, "finish"),
        _start(trace, router, "finish"),
    ]
    assert order == sorted(order), order
    verify = _spans(trace, decode, "verify")
    assert len(verify) == usage["spec_verify_steps"] > 0
    accepted = usage["completion_tokens_details"]["accepted_prediction_tokens"]
    assert sum(v["args"]["correct_drafts"] for v in verify) == accepted
    assert [v["args"]["step"] for v in verify] == list(range(1, len(verify) + 1))
    drafts = _spans(trace, decode, "draft")
    assert [d["args"]["chain_from"] for d in drafts[:2]] == ["prefill", "draft_extend"]
    assert {e["ph"] for e in trace["traceEvents"] if e.get("cat") == "request"} >= {"s", "f"}
    summary = usage["trace_summary"]
    assert summary == trace["otherData"]["trace_summary"]
    assert summary["ttft_ms"] > 0 and summary["e2e_ms"] >= summary["ttft_ms"]
    assert summary["transfer_ms"] >= 0 and summary["transfer_bytes"] > 0
    # What the prefill read from its prefix cache, and the positions whose KV it sent.
    [prefill_span] = _spans(trace, prefill, "prefill")
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert prefill_span["args"]["cached_tokens"] == cached
    [transfer] = _spans(trace, prefill, "transfer")
    reused = transfer["args"]["reused_tokens"]
    assert transfer["args"]["kv_tokens"] + reused == usage["prompt_tokens"]
    [landed] = [e for e in trace["traceEvents"] if e["name"] == "transfer_end"]
    assert landed["pid"] == decode and landed["args"]["reused_tokens"] == reused
    assert summary["accept_length"] == usage["spec_accept_length"]
    return reused


def test_tracing_flags_and_a_trace_dir_without_tracing():
    from cluster.commands.cli import build_parser
    from cluster.commands.demo import _forwarded_flags
    from cluster.deploy.config import ClusterConfig

    args = build_parser().parse_args(["demo", "--enable-tracing", "--trace-dir", "traces"])
    assert args.enable_tracing and Path(args.trace_dir).is_absolute()
    # The demo passes them on to `pdcluster serve`, the switch without a value.
    flags = _forwarded_flags(args)
    assert "--enable-tracing" in flags and flags[flags.index("--enable-tracing") + 1] != "True"
    with pytest.raises(ValueError, match="--enable-tracing"):
        ClusterConfig(trace_dir="traces")
