"""`pdcluster bench serving` against the real clusters on CPU: a soak of 1,000 short requests
through 1 prefill + 1 decode node with 64 in flight, and a sweep against the aggregated mode.
Every request must be accounted for and every node's KV pools empty afterwards (read from the
nodes). Timings are printed by the bench, never asserted."""

from __future__ import annotations

import json

import pytest
from cluster_helpers import launch, launch_aggregated, serve, wait_for
from tiny_models import make_tiny_llama

from cluster.bench_serving.cli import main as bench_serving

ray = pytest.importorskip("ray")

ENGINE = dict(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=64)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-load")
    make_tiny_llama(path)
    return str(path)


def run_bench(url: str, model: str, out, *flags: str) -> list[dict]:
    code = bench_serving(
        ["--url", url, "--tokenizer", model, "--endpoint", "completions", "--dataset", "random"]
        + ["--output-dir", str(out), "--disable-tqdm", *flags]
    )
    assert code == 0
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_soak_1000_requests_through_1p1d_lose_nothing_and_free_every_pool(tiny_model, tmp_path):
    cluster = launch(tiny_model, prefill=1, decode=1, **ENGINE)
    server = serve(cluster)
    try:
        [run] = run_bench(
            server.url,
            tiny_model,
            tmp_path,
            *["--num-prompts", "1000", "--max-concurrency", "64", "--request-rate", "inf"],
            *["--input-len", "12", "--output-len", "4", "--save-requests"],
        )
        assert (run["completed"], run["failed"], run["lost"]) == (1000, 0, 0), run["errors"]
        requests = (tmp_path / "requests.jsonl").read_text().splitlines()
        assert len(requests) == 1000
        assert sum(json.loads(line)["output_tokens"] for line in requests) == 4000
        assert wait_for(cluster.kv_pools_empty, 30)
        stats = {s["node"]: s for s in cluster.node_stats()}
        assert stats["prefill-0"]["prompts_done"] == 1000
        assert stats["decode-0"]["tokens_out"] == 4000
    finally:
        server.stop()
        cluster.shutdown()


def test_sweep_against_the_aggregated_mode_accounts_for_every_request(tiny_model, tmp_path):
    cluster = launch_aggregated(tiny_model, replicas=2, **ENGINE)
    server = serve(cluster)
    try:
        runs = run_bench(
            server.url,
            tiny_model,
            tmp_path,
            *["--num-prompts", "60", "--request-rate", "inf", "40", "--seed", "3"],
            *["--input-len", "24", "--output-len", "6", "--range-ratio", "0.5"],
            *["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"],
        )
        assert [run["request_rate"] for run in runs] == ["inf", 40.0]
        for run in runs:
            assert (run["completed"], run["failed"], run["lost"]) == (60, 0, 0), run["errors"]
            # Generous SLOs: every completed request is good.
            assert run["goodput"] == pytest.approx(run["request_throughput"])
        assert wait_for(cluster.kv_pools_empty, 30)
        served = {s["node"]: s["tokens_out"] for s in cluster.node_stats()}
        assert sum(served.values()) == sum(run["total_output_tokens"] for run in runs)
        assert all(served.values()), f"a replica took no request: {served}"
    finally:
        server.stop()
        cluster.shutdown()
