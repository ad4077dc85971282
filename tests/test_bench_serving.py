"""`pdcluster bench serving`: metrics from known request timings, the datasets, the stream parser,
the runner's accounting when interrupted (every sent request completed, failed or lost), and whole
runs against the project's own HTTP server over a tiny engine: sweeps, server errors, timeouts,
and Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_models import byte_tokenizer

from cluster.bench_serving.chat_conversations import CONVERSATIONS
from cluster.bench_serving.cli import add_bench_serving_args, run_bench_serving
from cluster.bench_serving.client import Target, api_root
from cluster.bench_serving.dataset_files import DatasetFileError, read_prompt_file
from cluster.bench_serving.datasets import (
    BenchRequest,
    DatasetSpec,
    Message,
    length_range,
    load_requests,
    plain_token_ids,
)
from cluster.bench_serving.metrics import LatencyStats, Slo, summarize
from cluster.bench_serving.report import format_summaries, plot_latency_vs_rate
from cluster.bench_serving.results import Outcome, RequestResult, RunResult
from cluster.bench_serving.runner import arrival_offsets, run_at_rate
from cluster.bench_serving.stream_events import parse_stream_line
from cluster.frontend.openai_api import BackgroundServer, create_app

REPO = Path(__file__).resolve().parent.parent
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def completed(index: int, ttft: float, e2e: float, tokens: int, **fields) -> RequestResult:
    return RequestResult(
        index, Outcome.COMPLETED, 0.0, 10, tokens, ttft_s=ttft, e2e_s=e2e, **fields
    )


# ---- metrics -------------------------------------------------------------------------------


def test_latency_stats_interpolate_percentiles_linearly():
    stats = LatencyStats.of([0.1, 0.2, 0.3, 0.4])
    # Ranks 1.5, 2.7 and 2.97 of 0..3: 250, 300 + 0.7 * 100, 300 + 0.97 * 100 (ms).
    assert (stats.mean, stats.p50, stats.p90, stats.p99) == (250.0, 250.0, 370.0, 397.0)
    assert LatencyStats.of([]).to_json() == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_counts_completed_requests_only():
    results = [
        completed(0, 0.1, 1.1, 11, itl_s=(0.1,) * 10),  # TPOT (1.1 - 0.1) / 10 = 100 ms
        completed(1, 0.3, 2.3, 21, itl_s=(0.1,) * 20),  # TPOT 100 ms
        completed(2, 0.2, 0.2, 1),  # one token: no TPOT, no ITL
        # Extreme timings that would move every statistic if they were counted:
        RequestResult(3, Outcome.FAILED, 0.0, 999, 0, ttft_s=50.0, e2e_s=60.0, error="400: no"),
        RequestResult(4, Outcome.LOST, 0.0, 999, 7, ttft_s=40.0, itl_s=(30.0,), error="timeout"),
    ]
    run = RunResult(request_rate=4.0, scheduled=6, started_at=0.0, duration_s=2.0, results=results)
    summary = summarize(run, Slo())
    assert (summary.completed, summary.failed, summary.lost, summary.sent) == (3, 1, 1, 5)
    assert summary.total_input_tokens == 30 and summary.total_output_tokens == 33
    assert summary.request_throughput == 1.5 and summary.output_token_throughput == 16.5
    assert summary.input_token_throughput == 15.0
    assert summary.ttft_ms == LatencyStats(200.0, 200.0, 280.0, 298.0)
    assert summary.tpot_ms == LatencyStats(100.0, 100.0, 100.0, 100.0)
    assert summary.itl_ms.mean == 100.0 and summary.itl_ms.p99 == 100.0
    assert summary.e2e_ms == LatencyStats(1200.0, 1100.0, 2060.0, 2276.0)
    assert summary.errors == {"400: no": 1, "timeout": 1}
    line = summary.to_json()
    assert line["request_rate"] == 4.0 and line["scheduled"] == 6
    assert line["ttft_ms"] == {"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0}
    assert line["goodput"] == 1.5 and line["spec_accept_length"] is None


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        completed(0, 0.05, 1.05, 11),  # TTFT 50 ms, TPOT 100 ms: meets both
        completed(1, 0.05, 2.05, 11),  # TTFT met, TPOT 200 ms missed
        completed(2, 0.50, 1.50, 11),  # TTFT 500 ms missed, TPOT met
        completed(3, 0.05, 0.05, 1),  # TTFT met, one token: no TPOT to miss
        RequestResult(4, Outcome.FAILED, 0.0, 10, 0, ttft_s=0.01, e2e_s=0.02, error="500"),
    ]
    run = RunResult(request_rate=10.0, scheduled=5, started_at=0.0, duration_s=4.0, results=results)
    both = summarize(run, Slo(ttft_ms=100.0, tpot_ms=150.0))
    assert both.good_requests == 2 and both.goodput == 0.5
    assert summarize(run, Slo(ttft_ms=100.0)).good_requests == 3
    assert summarize(run, Slo(tpot_ms=150.0)).good_requests == 3
    assert summarize(run, Slo()).good_requests == 4  # every completed request, no failed one
    assert both.to_json()["slo_ttft_ms"] == 100.0 and both.to_json()["slo_tpot_ms"] == 150.0


def test_accept_length_is_weighted_by_verify_steps():
    results = [
        completed(0, 0.1, 1.0, 30, spec_accept_length=3.0, spec_verify_steps=10),
        completed(1, 0.1, 1.0, 30, spec_accept_length=1.5, spec_verify_steps=20),
        completed(2, 0.1, 1.0, 30),  # the server reported none for this one
    ]
    run = RunResult(request_rate=1.0, scheduled=3, started_at=0.0, duration_s=1.0, results=results)
    assert summarize(run, Slo()).spec_accept_length == 2.0  # (30 + 30) / 30 steps


def test_tables_show_every_rate_and_the_failure_reasons():
    results = [completed(0, 0.1, 1.0, 10), RequestResult(1, Outcome.FAILED, 0, 5, 0, error="boom")]
    runs = [
        RunResult(rate, 2, 0.0, 1.0, results, interrupted=rate == 8.0) for rate in (np.inf, 8.0)
    ]
    text = format_summaries([summarize(run, Slo()) for run in runs])
    assert "inf" in text and "8 (interrupted)" in text
    for column in ("completed", "failed", "lost", "req/s", "out tok/s", "goodput/s", "p99"):
        assert column in text
    for latency in ("TTFT", "ITL", "TPOT", "E2E"):
        assert text.count(latency) == 2
    assert "1 x boom" in text


def test_plot_is_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    results = [completed(0, 0.1, 1.0, 10), completed(1, 0.2, 1.4, 10)]
    summaries = [summarize(RunResult(r, 2, 0.0, 1.0, results), Slo()) for r in (np.inf, 2.0)]
    path = tmp_path / "latency_vs_rate.png"
    assert plot_latency_vs_rate(summaries, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- datasets ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """One token per byte: lengths in tokens are lengths in UTF-8 bytes."""
    return byte_tokenizer()


def test_sharegpt_file_takes_the_first_human_turn_and_its_answer_length(tmp_path, tokenizer):
    entries = [
        {
            "conversations": [
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hey!"},
            ]
        },
        {"conversations": [{"from": "human", "value": "no answer"}]},
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "Tell me a joke"},
                {"from": "gpt", "value": "A short one: ..."},
                {"from": "human", "value": "another"},
                {"from": "gpt", "value": "no"},
            ]
        },
        {"id": "no conversations key"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    assert [entry.prompt for entry in read_prompt_file(path)] == ["Hi there", "Tell me a joke"]
    spec = DatasetSpec("file", num_prompts=4, path=str(path))
    requests = load_requests(spec, tokenizer)
    by_prompt = {request.prompt: request for request in requests}
    assert set(by_prompt) == {"Hi there", "Tell me a joke"}
    assert by_prompt["Hi there"].output_len == len("Hey!")
    assert by_prompt["Tell me a joke"].output_len == len("A short one: ...")
    assert by_prompt["Tell me a joke"].prompt_len == len("Tell me a joke")
    # Four prompts from two entries: each used twice, and each pass uses every entry once.
    assert sorted(r.prompt for r in requests[:2]) == sorted(r.prompt for r in requests[2:])


def test_jsonl_file_gives_prompts_and_output_lengths(tmp_path, tokenizer):
    lines = [
        {"prompt": "first", "output_len": 7},
        {"prompt": "second", "max_tokens": 9},
        {"prompt": "third"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    spec = DatasetSpec("file", num_prompts=3, output_len=5, path=str(path))
    requests = {r.prompt: r for r in load_requests(spec, tokenizer)}
    assert {p: r.output_len for p, r in requests.items()} == {"first": 7, "second": 9, "third": 5}
    assert requests["second"].prompt_len == len("second")
    assert requests["third"].chat_messages() == [{"role": "user", "content": "third"}]

    path.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(DatasetFileError, match="prompts.jsonl:2"):
        read_prompt_file(path)
    path.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(DatasetFileError, match="positive integer"):
        read_prompt_file(path)


@pytest.mark.parametrize(
    "length, ratio, bounds", [(100, 0.0, (100, 100)), (100, 0.3, (70, 130)), (3, 0.9, (1, 5))]
)
def test_length_range_follows_the_ratio(length, ratio, bounds):
    assert length_range(length, ratio) == bounds


def test_random_prompts_have_the_drawn_lengths(tokenizer):
    spec = DatasetSpec("random", num_prompts=40, input_len=60, output_len=20, range_ratio=0.5)
    requests = load_requests(spec, tokenizer)
    for request in requests:
        # What the server will count for this text (before any template or special token).
        assert request.prompt_len == len(tokenizer.encode(request.prompt, add_special_tokens=False))
        assert 30 <= request.prompt_len <= 90 and 10 <= request.output_len <= 30
    assert len({r.prompt_len for r in requests}) > 5 and len({r.output_len for r in requests}) > 5
    assert load_requests(spec, tokenizer) == requests  # seeded
    assert load_requests(DatasetSpec("random", 40, seed=1, input_len=60), tokenizer) != requests
    fixed = load_requests(DatasetSpec("random", 5, input_len=33, output_len=4), tokenizer)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(33, 4)] * 5


def test_random_prompts_use_tokens_that_survive_a_round_trip(tokenizer):
    vocabulary = set(plain_token_ids(tokenizer).tolist())
    # The 128 ASCII bytes; no special token, no lone byte of a multi-byte character.
    assert len(vocabulary) == 128 and not vocabulary & set(tokenizer.all_special_ids)
    assert all(tokenizer.decode([token]).isascii() for token in vocabulary)


def test_chat_dataset_sends_multi_turn_conversations(tokenizer):
    num_prompts = len(CONVERSATIONS) + 5
    requests = load_requests(DatasetSpec("chat", num_prompts=num_prompts), tokenizer)
    assert len(requests) == num_prompts
    # Every conversation once before any repeats.
    assert len({r.prompt for r in requests[: len(CONVERSATIONS)]}) == len(CONVERSATIONS)
    for request in requests:
        roles = [message["role"] for message in request.chat_messages()]
        assert len(roles) >= 3 and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert request.prompt.startswith("User: ") and request.prompt.endswith("\n\nAssistant:")
        assert request.prompt_len == len(tokenizer.encode(request.prompt, add_special_tokens=False))
        assert request.output_len >= 50


def test_built_in_conversations_have_realistic_lengths():
    assert 30 <= len(CONVERSATIONS) <= 60
    assert len({conversation.topic for conversation in CONVERSATIONS}) == len(CONVERSATIONS)
    user_words = [len(c.turns[i].split()) for c in CONVERSATIONS for i in range(0, len(c.turns), 2)]
    assert min(user_words) >= 10 and max(user_words) <= 300
    assert max(user_words) >= 150  # pasted code and documents, not only short questions


def test_unknown_dataset_lists_the_supported_ones(tokenizer):
    with pytest.raises(ValueError, match="random, chat, file"):
        load_requests(DatasetSpec("sharegpt", num_prompts=1), tokenizer)


# ---- arrivals, requests, stream events -----------------------------------------------------


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    offsets = arrival_offsets(20_000, 4.0, np.random.default_rng(0))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    assert abs(np.diff(offsets).mean() - 0.25) < 0.01
    assert np.array_equal(offsets, arrival_offsets(20_000, 4.0, np.random.default_rng(0)))
    assert not np.any(arrival_offsets(5, np.inf, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(5, 0.0, np.random.default_rng(0))


def test_request_body_and_base_url():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert api_root(url) == "http://h:8000"
    conversation = BenchRequest(
        "transcript",
        3,
        16,
        (Message("user", "hi"), Message("assistant", "yo"), Message("user", "?")),
    )
    chat = Target("http://h", "m", "chat", ignore_eos=True).body(conversation)
    assert (
        chat["messages"][1] == {"role": "assistant", "content": "yo"} and chat["max_tokens"] == 16
    )
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["ignore_eos"] is True and chat["model"] == "m"
    plain = Target("http://h", "m", "completions").body(conversation)
    assert plain["prompt"] == "transcript" and "ignore_eos" not in plain


def test_stream_events_of_the_servers_in_use():
    assert parse_stream_line("") is None and parse_stream_line(": keep-alive") is None
    assert parse_stream_line("data: [DONE]").done
    role_only = parse_stream_line('data: {"choices": [{"delta": {"role": "assistant"}}]}')
    assert not role_only.has_content
    for chunk in (
        '{"choices": [{"delta": {"content": "Hi"}}]}',
        '{"choices": [{"delta": {"reasoning_content": "hmm"}}]}',
        '{"choices": [{"text": "x", "finish_reason": "length"}]}',
        '{"choices": [{"text": "", "token_ids": [17]}]}',
    ):
        assert parse_stream_line(f"data: {chunk}").has_content, chunk
    usage = parse_stream_line(
        'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, '
        '"spec_accept_length": 2.5, "spec_verify_steps": 4}}'
    ).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 9)
    assert (usage.spec_accept_length, usage.spec_verify_steps) == (2.5, 4)
    error = parse_stream_line('data: {"error": {"message": "node died", "code": 503}}').error
    assert "503" in error and "node died" in error
    assert "bad" in parse_stream_line('data: {"object": "error", "message": "bad"}').error
    with pytest.raises(ValueError):
        parse_stream_line("data: {not json")


# ---- the runner's accounting ---------------------------------------------------------------


def fake_requests(count: int) -> list[BenchRequest]:
    return [BenchRequest(f"prompt {i}", 5, 3) for i in range(count)]


def run_then_interrupt(send, started: asyncio.Event, count: int, **options) -> RunResult:
    async def scenario() -> RunResult:
        run = asyncio.create_task(
            run_at_rate(fake_requests(count), np.inf, send, show_progress=False, **options)
        )
        await asyncio.wait_for(started.wait(), timeout=10)
        run.cancel()  # what asyncio.run does to its main task on Ctrl-C
        return await run

    return asyncio.run(scenario())


def test_an_interrupted_run_counts_requests_in_flight_as_lost():
    calls, started = [], asyncio.Event()

    async def send(request: BenchRequest, index: int) -> RequestResult:
        calls.append(index)
        if len(calls) == 8:
            started.set()
        if index < 3:
            return completed(index, 0.01, 0.02, 3)
        await asyncio.Event().wait()  # a generation that never ends

    run = run_then_interrupt(send, started, count=8)
    assert run.interrupted and run.sent == 8
    assert [r.index for r in run.with_outcome(Outcome.COMPLETED)] == [0, 1, 2]
    lost = run.with_outcome(Outcome.LOST)
    assert len(lost) == 5 and all("interrupted" in r.error for r in lost)
    summary = summarize(run, Slo())
    assert summary.completed + summary.failed + summary.lost == run.sent == 8


def test_requests_waiting_for_a_concurrency_slot_were_never_sent():
    started = asyncio.Event()

    async def send(request: BenchRequest, index: int) -> RequestResult:
        if index == 1:
            started.set()
        await asyncio.Event().wait()

    run = run_then_interrupt(send, started, count=6, max_concurrency=2)
    assert run.scheduled == 6 and run.sent == 2
    assert [r.outcome for r in run.results] == [Outcome.LOST, Outcome.LOST]


def test_a_benchmark_error_is_a_failed_request_with_its_reason():
    async def send(request: BenchRequest, index: int) -> RequestResult:
        raise RuntimeError("bug in the sender")

    run = asyncio.run(run_at_rate(fake_requests(3), 50.0, send, show_progress=False))
    assert not run.interrupted and run.sent == 3
    assert all("bug in the sender" in r.error for r in run.with_outcome(Outcome.FAILED))
    assert len(run.with_outcome(Outcome.FAILED)) == 3


# ---- against the project's own server ------------------------------------------------------


@pytest.fixture(scope="module")
def server(backend):
    """The HTTP API over a tiny engine (256-token context), model name "tiny"."""
    with BackgroundServer(create_app(backend)) as server:
        yield server


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_bench_serving_args(parser)
    return run_bench_serving(parser.parse_args(["--disable-tqdm", *argv]))


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def slow_steps(monkeypatch, backend, seconds: float) -> None:
    """Make each engine step take a while, so that requests are surely still running."""
    step = backend.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(backend.engine, "step", slow_step)


def holds_requests(backend) -> bool:
    return not backend.engine.kv_cache.is_empty()


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_sweep_against_the_server(server, tiny_model_path, tmp_path, capsys):
    out = tmp_path / "out"
    code = bench(
        "--url", f"{server.url}/v1",
        "--model", "tiny",
        "--tokenizer", str(tiny_model_path),
        "--num-prompts", "12",
        "--request-rate", "inf", "20",
        "--input-len", "24",
        "--output-len", "6",
        "--output-dir", str(out),
        "--save-requests",
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput/s" in printed
    runs = read_lines(out / "results.jsonl")
    assert [run["request_rate"] for run in runs] == ["inf", 20.0]
    for run in runs:
        assert (run["sent"], run["completed"], run["failed"], run["lost"]) == (12, 12, 0, 0)
        assert not run["interrupted"] and run["duration_s"] > 0
        # ignore_eos is on for random prompts: every answer has exactly max_tokens.
        assert run["total_output_tokens"] == 12 * 6
        assert run["total_input_tokens"] >= 12 * 24  # the server's count, template included
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(run[key]) == {"mean", "p50", "p90", "p99"}
            assert run[key]["p50"] is not None and run[key]["p99"] >= run[key]["p50"]
        assert run["request_throughput"] > 0 and run["output_token_throughput"] > 0
        assert run["input_token_throughput"] > 0 and run["goodput"] == run["request_throughput"]
        assert run["spec_accept_length"] is None  # no speculative decoding here
        assert run["model"] == "tiny" and run["endpoint"] == "chat"
        assert run["dataset"]["name"] == "random" and run["dataset"]["input_len"] == 24
        assert run["dataset"]["mean_prompt_len"] == 24 and run["dataset"]["mean_output_len"] == 6
    requests = read_lines(out / "requests.jsonl")
    assert len(requests) == 24
    assert sorted(r["index"] for r in requests if r["request_rate"] == 20.0) == list(range(12))
    for request in requests:
        assert request["outcome"] == "completed" and request["error"] is None
        assert request["output_tokens"] == 6 and request["ttft_ms"] <= request["e2e_ms"]
        assert request["tpot_ms"] is not None
    assert (out / "latency_vs_rate.png").exists() == HAS_MATPLOTLIB


def test_completions_with_file_prompts_and_the_listed_model(server, tiny_model_path, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Tell me {i}", "output_len": 3}) + "\n" for i in range(4))
    )
    out = tmp_path / "out"
    code = bench(
        "--url", server.url,
        "--tokenizer", str(tiny_model_path),
        "--endpoint", "completions",
        "--dataset-path", str(path),
        "--num-prompts", "6",
        "--max-concurrency", "2",
        "--output-dir", str(out),
    )  # fmt: skip
    assert code == 0
    [run] = read_lines(out / "results.jsonl")
    assert run["model"] == "tiny" and run["endpoint"] == "completions"  # from GET /v1/models
    assert run["max_concurrency"] == 2 and not run["ignore_eos"]
    assert run["dataset"]["name"] == "file" and run["dataset"]["path"] == str(path)
    assert (run["sent"], run["completed"]) == (6, 6)
    assert 6 <= run["total_output_tokens"] <= 18  # up to 3 each, fewer if EOS comes first
    assert not (out / "requests.jsonl").exists()


def test_server_errors_count_as_failed_with_their_reason(server, tiny_model_path, tmp_path):
    path = tmp_path / "prompts.jsonl"
    prompts = ["short one", "y" * 300, "short two", "z" * 400]  # 300 bytes > 256-token context
    path.write_text("".join(json.dumps({"prompt": p, "output_len": 4}) + "\n" for p in prompts))
    out = tmp_path / "out"
    code = bench(
        "--url", server.url,
        "--tokenizer", str(tiny_model_path),
        "--endpoint", "completions",
        "--dataset-path", str(path),
        "--num-prompts", "4",
        "--output-dir", str(out),
        "--save-requests",
    )  # fmt: skip
    assert code == 0
    [run] = read_lines(out / "results.jsonl")
    assert (run["sent"], run["completed"], run["failed"], run["lost"]) == (4, 2, 2, 0)
    failed = [r for r in read_lines(out / "requests.jsonl") if r["outcome"] == "failed"]
    assert len(failed) == 2
    assert all(r["error"].startswith("400: ") and "context" in r["error"] for r in failed)
    assert sum(run["errors"].values()) == 2


def test_requests_past_the_timeout_are_lost(
    server, backend, tiny_model_path, tmp_path, monkeypatch
):
    slow_steps(monkeypatch, backend, 0.05)  # 200 tokens: about 10 s
    out = tmp_path / "out"
    code = bench(
        "--url", server.url,
        "--tokenizer", str(tiny_model_path),
        "--num-prompts", "3",
        "--input-len", "16",
        "--output-len", "200",
        "--timeout", "0.5",
        "--output-dir", str(out),
    )  # fmt: skip
    assert code == 0
    [run] = read_lines(out / "results.jsonl")
    assert (run["sent"], run["completed"], run["failed"], run["lost"]) == (3, 0, 0, 3)
    assert list(run["errors"]) == ["no end within the 0.5 s timeout"]
    # The server saw the clients go and aborted their requests.
    wait_until(lambda: not holds_requests(backend))


def test_ctrl_c_stops_the_sweep_and_keeps_what_was_measured(
    server, backend, tiny_model_path, tmp_path, monkeypatch
):
    slow_steps(monkeypatch, backend, 0.05)
    out = tmp_path / "out"
    argv = [
        "--url", server.url,
        "--tokenizer", str(tiny_model_path),
        "--num-prompts", "4",
        "--request-rate", "inf", "10",
        "--input-len", "16",
        "--output-len", "200",
        "--output-dir", str(out),
        "--disable-tqdm",
    ]  # fmt: skip
    # A terminal's Ctrl-C: SIGINT with Python's own handler, even where this test runs with
    # SIGINT ignored (a background job's children inherit that).
    launcher = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from cluster.bench_serving.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    bench_process = subprocess.Popen(
        [sys.executable, "-c", launcher, *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: holds_requests(backend) or bench_process.poll() is not None, 60)
        bench_process.send_signal(signal.SIGINT)
        output, _ = bench_process.communicate(timeout=60)
    finally:
        if bench_process.poll() is None:
            bench_process.kill()
    assert bench_process.returncode == 130, output
    [run] = read_lines(out / "results.jsonl")  # the second rate never started
    assert run["interrupted"] and run["request_rate"] == "inf"
    assert run["lost"] >= 1 and run["completed"] + run["failed"] + run["lost"] == run["sent"]
    assert "interrupted" in output and "TTFT" in output
    wait_until(lambda: not holds_requests(backend))
