"""Observability: GET /metrics in Prometheus format (request latencies, per-node load, KV usage,
transfers, speculation, failures by kind) for a cluster, a speculative cluster and a LocalBackend;
and the line a busy node logs every few seconds."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest
from cluster_helpers import launch, serve, wait_for
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

from cluster.commands.cli import build_parser
from cluster.control.local_backend import LocalBackend
from cluster.control.metrics import ClusterMetrics, RequestTimer
from cluster.frontend.openai_api import create_app
from engine import LLM
from metadata.control_auth import new_control_key
from metadata.node_common import NodeOptions, metadata_buffers
from metadata.node_metrics import Activity, ActivityLog, TransferTotals, format_activity
from metadata.transfer import TransferHandle, TransferState
from metadata.wire import transfer_nbytes

ray = pytest.importorskip("ray")

ENGINE = dict(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=16)
PROMPTS = ["hello there", "a", "the quick brown fox", "1 2 3 4 5 6 7 8 9"]


# --- reading an exposition ---
def parse(text: str) -> dict[str, list]:
    """Every sample by its full name (e.g. `..._bucket`, `..._total`)."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matches = [
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def scrape(url: str) -> dict[str, list]:
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


# --- a plain cluster ---
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-metrics")
    make_tiny_llama(path)
    cluster = launch(str(path), prefill=1, decode=1, **ENGINE)
    # Fresh node stats on every scrape: the tests compare them right after requests end.
    cluster.router.metrics.nodes._max_age_s = 0.0
    server = serve(cluster)
    yield cluster, server
    server.stop()
    cluster.shutdown()


def transfer_bytes(cluster, prompt_len: int) -> int:
    """What one transfer of a `prompt_len`-token prompt puts on the wire (no speculation)."""
    config = cluster.spec.model_config
    pool = SimpleNamespace(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=cluster.spec.engine_config.dtype,
    )
    options = NodeOptions("prefill", 0, control_key=new_control_key())
    metadata = metadata_buffers(cluster.spec, options, 0)
    return transfer_nbytes([(pool, prompt_len)], metadata.row_nbytes)


def test_cluster_metrics_cover_latency_nodes_and_transfers(plain):
    cluster, server = plain
    before = scrape(server.url)
    usages = [complete(server.url, prompt, 6) for prompt in PROMPTS]
    assert wait_for(cluster.kv_pools_empty, 30)
    after = scrape(server.url)

    def grew(name: str, **labels: str) -> float:
        old = value(before, name, **labels) if before.get(name) else 0.0
        return value(after, name, **labels) - old

    n = len(PROMPTS)
    completion = sum(u["completion_tokens"] for u in usages)
    assert grew("pdcluster_time_to_first_token_seconds_count") == n
    assert grew("pdcluster_e2e_request_latency_seconds_count") == n
    # Without speculation every delta carries one token: every token after the first is timed.
    assert grew("pdcluster_inter_token_latency_seconds_count") == completion - n
    assert grew("pdcluster_requests_total", finish_reason="length") == n
    assert grew("pdcluster_generation_tokens_total") == completion
    assert grew("pdcluster_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value(after, "pdcluster_time_to_first_token_seconds_bucket", le="+Inf") >= n

    for node, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert value(after, "pdcluster_node_up", node=node, role=role) == 1
        assert value(after, "pdcluster_node_kv_used_tokens", node=node) == 0
        assert value(after, "pdcluster_node_kv_usage_ratio", node=node) == 0
        assert value(after, "pdcluster_node_kv_capacity_tokens", node=node) > 0
        assert value(after, "pdcluster_node_queued_requests", node=node) == 0
        assert value(after, "pdcluster_node_transfers_in_flight", node=node) == 0
        assert value(after, "pdcluster_node_in_flight_requests", node=node) == 0
    assert value(after, "pdcluster_node_running_requests", node="decode-0") == 0
    assert grew("pdcluster_node_generation_tokens_total", node="decode-0") == completion

    expected_bytes = sum(transfer_bytes(cluster, u["prompt_tokens"]) for u in usages)
    for node, direction in (("prefill-0", "send"), ("decode-0", "receive")):
        labels = dict(node=node, direction=direction)
        assert grew("pdcluster_node_transfers_total", **labels) == n
        assert grew("pdcluster_node_transfer_failures_total", **labels) == 0
        assert grew("pdcluster_node_transfer_bytes_total", **labels) == expected_bytes
        # Prompts with no prefix in common: each transfer carries all of its prompt.
        prompt_tokens = sum(u["prompt_tokens"] for u in usages)
        assert grew("pdcluster_node_transfer_kv_tokens_total", **labels) == prompt_tokens
        assert grew("pdcluster_node_transfer_reused_tokens_total", **labels) == 0
        assert grew("pdcluster_node_transfer_seconds_total", **labels) > 0
        assert grew("pdcluster_node_transfer_latency_seconds_count", **labels) == n
        assert value(after, "pdcluster_node_transfer_gigabytes_per_second", **labels) > 0


def test_parallel_samples_count_their_prompt_once(plain):
    cluster, server = plain
    before = scrape(server.url)
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "n": 3, "seed": 1, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    after = scrape(server.url)

    def grew(name: str, **labels: str) -> float:
        counted = [s for s in before.get(name, []) if s.labels == labels]
        return value(after, name, **labels) - (counted[0].value if counted else 0.0)

    assert usage["completion_tokens"] == grew("pdcluster_generation_tokens_total") == 12
    assert grew("pdcluster_prompt_tokens_total") == usage["prompt_tokens"] > 0
    assert grew("pdcluster_requests_total", finish_reason="length") == 3


def test_cluster_counts_rejected_and_aborted_requests(plain):
    cluster, server = plain

    def failures(kind: str) -> float:
        return value(scrape(server.url), "pdcluster_request_failures_total", kind=kind)

    rejected, aborted = failures("rejected"), failures("aborted")
    assert failures("node_down") == 0
    too_long = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 4}, timeout=30
    )
    assert too_long.status_code == 400
    assert failures("rejected") == rejected + 1

    body = {"prompt": "keep going", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line.startswith("data:"))
        # Leaving the block closes the connection mid-stream.
    assert wait_for(lambda: failures("aborted") == aborted + 1, 30)
    assert wait_for(cluster.kv_pools_empty, 30)


# --- a speculative cluster ---
def test_speculative_cluster_reports_accept_length_and_acceptance_per_position(tmp_path):
    make_predictable_llama(tmp_path / "target", seed=0)
    make_good_draft(tmp_path / "draft", tmp_path / "target", 3, noise=0.01)
    cluster = launch(
        str(tmp_path / "target"),
        prefill=1,
        decode=1,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(tmp_path / "draft"),
        num_draft_steps=3,
        **ENGINE,
    )
    server = serve(cluster)
    try:
        prompts = [[1, 17, 99, 4, 250, 31, 8], list(range(3, 40)), [5] * 23]
        usages = [complete(server.url, prompt, 16) for prompt in prompts]
        assert wait_for(cluster.kv_pools_empty, 30)
        samples = scrape(server.url)
    finally:
        server.stop()
        cluster.shutdown()

    n = len(prompts)
    assert value(samples, "pdcluster_spec_accept_length_count") == n
    total = sum(u["spec_accept_length"] for u in usages)
    assert value(samples, "pdcluster_spec_accept_length_sum") == pytest.approx(total)
    # Deltas carry several tokens now; each token after the first is still timed once.
    completion = sum(u["completion_tokens"] for u in usages)
    assert value(samples, "pdcluster_inter_token_latency_seconds_count") == completion - n

    node = dict(node="decode-0", role="decode")
    steps = sum(u["spec_verify_steps"] for u in usages)
    assert value(samples, "pdcluster_node_spec_verify_steps_total", **node) == steps
    accepted = [
        value(samples, "pdcluster_node_spec_accepted_tokens_total", position=str(p), **node)
        for p in (1, 2, 3)
    ]
    details = [u["completion_tokens_details"] for u in usages]
    assert sum(accepted) == sum(d["accepted_prediction_tokens"] for d in details)
    assert accepted[0] > 0  # the good draft's first guesses mostly hold
    assert accepted[0] >= accepted[1] >= accepted[2]  # a chain: position j needs j - 1 first
    for position, count in enumerate(accepted, start=1):
        rate = value(samples, "pdcluster_node_spec_acceptance_rate", position=str(position))
        assert rate == pytest.approx(count / steps)
    # Every decode step is counted by its round plan: each verify step is a request's in a
    # round (one request at a time here), and a round with nothing left to verify may follow.
    plans = {
        sample.labels["plan"]: sample
        for sample in samples["pdcluster_node_spec_plans_total"]
        if sample.labels["node"] == "decode-0"
    }
    assert all(p.labels["kind"] == plan.partition("/")[0] for plan, p in plans.items())
    rounds = sum(p.value for plan, p in plans.items() if plan.startswith("chain/"))
    assert rounds >= steps > 0
    # Each node's serving thread accounts for its time, and its engine for its steps: the
    # decode node ran every request's decode steps, the prefill node one prefill a prompt here.
    for name in ("prefill-0", "decode-0"):
        assert value(samples, "pdcluster_node_loop_seconds_total", node=name, part="engine") > 0
        assert value(samples, "pdcluster_node_loop_seconds_total", node=name, part="waiting") > 0
    assert value(samples, "pdcluster_node_steps_total", node="decode-0", kind="decode") >= steps
    assert value(samples, "pdcluster_node_steps_total", node="decode-0", kind="prefill") == 0
    assert value(samples, "pdcluster_node_steps_total", node="prefill-0", kind="prefill") == n
    # The target's KV and each draft depth's cross: more than the plain wire size.
    sent = value(samples, "pdcluster_node_transfer_bytes_total", node="prefill-0")
    assert sent == value(samples, "pdcluster_node_transfer_bytes_total", node="decode-0") > 0


# --- the local backend ---
def test_local_backend_serves_metrics(tiny_model_path):
    llm = LLM(str(tiny_model_path), device="cpu", **ENGINE)
    backend = LocalBackend(llm, model_name="tiny")
    try:
        with TestClient(create_app(backend)) as client:
            for prompt in PROMPTS[:2]:
                body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True}
                assert client.post("/v1/completions", json=body).status_code == 200
            body = {"prompt": "x" * 300, "max_tokens": 4}
            assert client.post("/v1/completions", json=body).status_code == 400
            response = client.get("/metrics")
        assert response.status_code == 200
        samples = parse(response.text)
    finally:
        backend.close()
    assert value(samples, "pdcluster_time_to_first_token_seconds_count") == 2
    assert value(samples, "pdcluster_e2e_request_latency_seconds_count") == 2
    assert value(samples, "pdcluster_inter_token_latency_seconds_count") == 2 * 4
    assert value(samples, "pdcluster_request_failures_total", kind="rejected") == 1
    assert value(samples, "pdcluster_node_kv_used_tokens", node="local") == 0
    assert value(samples, "pdcluster_node_kv_capacity_tokens", node="local") > 0
    assert value(samples, "pdcluster_node_up", node="local") == 1


def test_a_backend_without_metrics_answers_404():
    class NoMetrics:
        model_name, max_model_len, tokenizer = "none", 16, None

    with TestClient(create_app(NoMetrics())) as client:
        response = client.get("/metrics")
    assert response.status_code == 404
    assert "metrics" in response.json()["error"]["message"]


# --- units: no Ray ---
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_request_timer_observes_ttft_then_each_token_after_it():
    metrics, clock = ClusterMetrics([]), FakeClock()
    timer = RequestTimer(metrics, clock)
    clock.now += 0.5
    timer.tokens(1)
    clock.now += 0.3
    timer.tokens(3)  # a speculative step: 0.1 s per token
    timer.tokens(0)  # a delta with no tokens times nothing
    timer.finished("stop", {"prompt_tokens": 7, "spec_accept_length": 2.5})
    timer.failed("aborted")
    samples = parse(asyncio.run(metrics.render()).decode())
    assert value(samples, "pdcluster_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(samples, "pdcluster_inter_token_latency_seconds_count") == 3
    assert value(samples, "pdcluster_inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(samples, "pdcluster_inter_token_latency_seconds_bucket", le="0.1") == 3
    assert value(samples, "pdcluster_e2e_request_latency_seconds_sum") == pytest.approx(0.8)
    assert value(samples, "pdcluster_spec_accept_length_sum") == 2.5
    assert value(samples, "pdcluster_prompt_tokens_total") == 7
    assert value(samples, "pdcluster_request_failures_total", kind="aborted") == 1
    assert value(samples, "pdcluster_request_failures_total", kind="transfer") == 0


def test_a_prompts_parallel_samples_count_its_tokens_once():
    metrics = ClusterMetrics([])
    for timer in metrics.samples(3):
        timer.tokens(2)
        timer.finished("length", {"prompt_tokens": 7})
    metrics.request().finished("stop", {"prompt_tokens": 5})
    samples = parse(asyncio.run(metrics.render()).decode())
    assert value(samples, "pdcluster_prompt_tokens_total") == 12
    assert value(samples, "pdcluster_requests_total", finish_reason="length") == 3
    assert value(samples, "pdcluster_generation_tokens_total") == 6


def test_node_stats_are_cached_between_scrapes_and_registries_are_separate():
    calls = []

    def node(name: str, stats: dict | None, alive: bool = True):
        async def read() -> dict:
            calls.append(name)
            if stats is None:
                raise RuntimeError("gone")
            return stats

        return SimpleNamespace(name=name, role="decode", alive=alive, in_flight=2, stats=read)

    stats = {"running": 1, "queued": 0, "kv_used": 30, "kv_capacity": 120}
    nodes = [node("decode-0", stats), node("decode-1", None), node("decode-2", {}, alive=False)]
    first, second = ClusterMetrics(nodes), ClusterMetrics(nodes)  # no clash over names

    async def scrape_twice() -> str:
        await first.render()
        return (await first.render()).decode()

    samples = parse(asyncio.run(scrape_twice()))
    assert calls == ["decode-0", "decode-1"]  # one fetch per live node for both scrapes
    assert value(samples, "pdcluster_node_kv_usage_ratio", node="decode-0") == 0.25
    assert value(samples, "pdcluster_node_in_flight_requests", node="decode-1") == 2
    # A node whose stats failed, or that is down, has no load samples.
    assert [s.labels["node"] for s in samples["pdcluster_node_kv_used_tokens"]] == ["decode-0"]
    assert value(samples, "pdcluster_node_up", node="decode-2") == 0
    first.failure("rejected")
    other = parse(asyncio.run(second.render()).decode())
    assert value(other, "pdcluster_request_failures_total", kind="rejected") == 0


def test_decode_steps_are_counted_by_plan_and_kind():
    stats = {"running": 1, "spec_plans": {"plain": 5, "plain/catch_up": 1, "chain/device": 7}}

    async def read() -> dict:
        return stats

    node = SimpleNamespace(name="replica-0", role="replica", alive=True, in_flight=0, stats=read)
    samples = parse(asyncio.run(ClusterMetrics([node]).render()).decode())
    counted = {
        (s.labels["kind"], s.labels["plan"]): s.value
        for s in samples["pdcluster_node_spec_plans_total"]
    }
    assert counted == {
        ("plain", "plain"): 5,
        ("plain", "plain/catch_up"): 1,
        ("chain", "chain/device"): 7,
    }


def test_loop_seconds_and_steps_are_exported_by_part_and_kind():
    stats = {
        "loop_seconds": {"waiting": 2.5, "engine": 7.0, "streams": 0.5, "other": 0.25},
        "steps": {"decode": 90, "prefill": 3, "mixed": 4, "drains": 6},
    }

    async def read() -> dict:
        return stats

    node = SimpleNamespace(name="decode-0", role="decode", alive=True, in_flight=0, stats=read)
    samples = parse(asyncio.run(ClusterMetrics([node]).render()).decode())
    parts = {s.labels["part"]: s.value for s in samples["pdcluster_node_loop_seconds_total"]}
    kinds = {s.labels["kind"]: s.value for s in samples["pdcluster_node_steps_total"]}
    assert parts == stats["loop_seconds"] and kinds == stats["steps"]


def test_transfer_totals_count_successes_bytes_and_latency_buckets():
    totals = TransferTotals("send")
    for nbytes, seconds, reused in ((1000, 0.002, 0), (3000, 0.2, 7)):
        handle = TransferHandle(room=1, peer=1)
        handle.nbytes, handle.elapsed_s = nbytes, seconds
        handle.advance(TransferState.SUCCESS)
        totals.record(handle, kv_tokens=10, reused_tokens=reused)
    failed = TransferHandle(room=2, peer=1)
    failed.fail("broken")
    totals.record(failed, kv_tokens=5, reused_tokens=5)  # a failure counts no positions
    report = totals.as_dict()
    assert (report["count"], report["failed"], report["bytes"]) == (2, 1, 4000)
    assert (report["kv_tokens"], report["reused_tokens"]) == (20, 7)
    assert report["seconds"] == pytest.approx(0.202)
    buckets = dict((bound, count) for bound, count in report["latency_buckets"])
    assert (buckets[0.001], buckets[0.0025], buckets[0.1], buckets[0.25]) == (0, 1, 1, 2)
    assert buckets[float("inf")] == 2


def test_activity_log_logs_only_when_due_and_busy(caplog):
    clock, snapshots = FakeClock(), []
    current = Activity(3, 1, 2, 50, 200, tokens=0)

    def snapshot() -> Activity:
        snapshots.append(current)
        return current

    activity_log = ActivityLog(5.0, logging.getLogger("test-node"), clock)
    clock.now += 4.9
    assert activity_log.tick(snapshot) is None
    assert not snapshots  # not due: nothing built

    clock.now += 0.1
    current = Activity(3, 1, 2, 50, 200, tokens=100, spec_verify_steps=10, spec_emitted_tokens=25)
    with caplog.at_level(logging.INFO, logger="test-node"):
        line = activity_log.tick(snapshot)
    assert line == (
        "running=3 queued=1 tokens/s=20.0 accept_length=2.50 kv=25.0% transfers_in_flight=2"
    )
    assert line in caplog.text

    clock.now += 5.0
    current = Activity(0, 0, 0, 0, 200, tokens=100, spec_verify_steps=10, spec_emitted_tokens=25)
    assert activity_log.tick(snapshot) is None  # idle: no line

    assert ActivityLog(0, logging.getLogger("off"), clock).tick(snapshot) is None


def test_activity_line_of_a_prefill_node_has_no_running_set():
    before = Activity(None, 0, 0, 0, 100, tokens=0)
    now = Activity(None, 4, 1, 10, 100, tokens=300)
    assert format_activity(now, before, 2.0) == (
        "queued=4 tokens/s=150.0 kv=10.0% transfers_in_flight=1"
    )


def test_serve_takes_a_log_level_and_a_stats_interval():
    args = build_parser().parse_args(["serve", "--log-level", "debug", "--log-stats-interval", "2"])
    assert (args.log_level, args.log_stats_interval) == ("debug", 2.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "loud"])
