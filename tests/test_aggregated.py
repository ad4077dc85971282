"""The aggregated cluster on CPU: replicas that each prefill and decode their own requests,
behind the same router and HTTP API as the disaggregated cluster, with the same usage fields and
failure behaviour."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from cluster_helpers import launch_aggregated, serve, wait_for
from tiny_models import CHAT_TEMPLATE, make_tiny_llama

from cluster.client import AsyncClient, Client
from cluster.deploy.config import ClusterConfig
from engine import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = ["hello there", "a", "the quick brown fox jumps", "1 2 3 4 5 6 7", "zzz", "tokens!"]
ENGINE = dict(max_model_len=512, kv_cache_tokens=4096, max_num_seqs=32)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-aggregated")
    make_tiny_llama(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    cluster = launch_aggregated(tiny_model, replicas=2, tracing=True, **ENGINE)
    server = serve(cluster)
    yield cluster, server
    server.stop()
    cluster.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, device="cpu", **ENGINE)


def test_greedy_and_seeded_output_equal_the_offline_engine(cluster, offline):
    _, server = cluster
    greedy = offline.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    [sampled] = offline.generate([PROMPTS[2]], seeded)
    with Client(server.url) as client:
        for prompt, ref in zip(PROMPTS, greedy):
            out = client.generate(prompt, max_tokens=20, temperature=0)
            assert (out.token_ids, out.text, out.finish_reason) == (
                ref.token_ids,
                ref.text,
                ref.finish_reason,
            )
        out = client.generate(
            PROMPTS[2], max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
        )
    assert out.token_ids == sampled.token_ids


def test_concurrent_streams_use_every_replica_and_free_their_kv(cluster, offline):
    cluster_, server = cluster
    prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(40)]
    expected = offline.generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )

    async def run_all():
        async with AsyncClient(server.url, timeout=300) as client:

            async def one(prompt):
                ids, last = [], None
                stream = await client.generate(
                    prompt, max_tokens=10, temperature=0, ignore_eos=True, stream=True
                )
                async for chunk in stream:
                    ids += chunk.token_ids
                    last = chunk
                return ids, last

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run_all())
    replicas = set()
    for (ids, last), ref in zip(results, expected):
        assert ids == ref.token_ids and last.finish_reason == "length"
        usage = last.usage
        assert usage.completion_tokens == 10
        # Same usage fields as the disaggregated cluster: the replica stands for both roles.
        extra = usage.extra
        assert extra["prefill_node"] == extra["decode_node"]
        replicas.add(extra["decode_node"])
    assert replicas == {"replica-0", "replica-1"}
    assert wait_for(cluster_.kv_pools_empty, 30)


def test_traces_have_the_router_and_the_replica(cluster):
    cluster_, server = cluster
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": "trace me", "max_tokens": 6, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200
        reply = response.json()
        summary = reply["usage"]["trace_summary"]
        assert summary["ttft_ms"] > 0 and summary["e2e_ms"] >= summary["ttft_ms"]
        assert summary["transfer_ms"] is None  # nothing crosses
        trace = http.get(f"/v1/traces/{reply['id']}").json()
    tracks = {
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert tracks == {"router", reply["usage"]["decode_node"]}
    spans = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"prefill", "decode"} <= spans


def test_client_disconnect_aborts_and_frees_the_replicas_kv(cluster):
    cluster_, server = cluster

    def decoded() -> int:
        return sum(s.get("tokens_out", 0) for s in cluster_.node_stats())

    before = decoded()
    body = {"prompt": "keep going", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line.startswith("data:"))
    assert wait_for(cluster_.kv_pools_empty, 30)
    assert decoded() - before < 480


def test_bad_input_is_a_400_and_health_lists_the_replicas(cluster):
    _, server = cluster
    with httpx.Client(base_url=server.url) as http:
        response = http.post("/v1/completions", json={"prompt": "x" * 600, "max_tokens": 4})
        assert response.status_code == 400
        assert "context" in response.json()["error"]["message"]
        health = http.get("/health").json()
    assert health["status"] == "ok"
    assert {n["name"] for n in health["nodes"]} == {"replica-0", "replica-1"}


def test_an_aggregated_cluster_needs_a_replica():
    with pytest.raises(ValueError, match="at least one replica"):
        ClusterConfig(aggregated=True, replicas=0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        ClusterConfig(gpus_per_node=1.5)


def test_a_dead_replica_ends_its_requests_with_an_error_naming_it(tiny_model):
    cluster = launch_aggregated(tiny_model, replicas=2, **ENGINE)
    server = serve(cluster)
    try:
        body = {"prompt": "stream", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
        outcomes: list[str] = []
        started = threading.Barrier(7)

        def stream_one() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    first = True
                    for line in r.iter_lines():
                        if first and line.startswith("data:"):
                            first = False
                            started.wait(timeout=60)
                        if line.startswith("data:") and '"error"' in line:
                            outcomes.append("error:" + json.loads(line[5:])["error"]["message"])
                            return
                        if line == "data: [DONE]":
                            outcomes.append("done")
                            return

        threads = [threading.Thread(target=stream_one) for _ in range(6)]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        ray.kill(cluster.decode_actors[0])
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
        errors = [o for o in outcomes if o.startswith("error:")]
        assert errors and all("replica-0 died" in e for e in errors)
        assert len(outcomes) == 6
        with Client(server.url) as client:
            out = client.generate("after", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4
            # Down until its replacement serves (cluster.control.supervisor), then back.
            health = client.health()
            node = next(n for n in health["nodes"] if n["name"] == "replica-0")
            replaced = node["status"] == "ok" and node["restarts"] == 1
            down = node["status"] in ("down", "restarting") and health["status"] == "degraded"
            assert down or replaced, health
    finally:
        server.stop()
        cluster.shutdown()


def test_replicas_report_their_load_to_the_router(cluster):
    """The router's least_load weighs the requests each replica says it holds (NodeLoad): a
    long request shows on its replica while it runs, and both report none once it ended."""
    cluster_, server = cluster
    nodes = cluster_.router.decode_nodes
    httpx.get(f"{server.url}/health", timeout=30)  # the router starts on first use
    assert wait_for(lambda: all(n.reported_requests is not None for n in nodes), 10)
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            assert wait_for(lambda: sum(n.reported_requests for n in nodes) == 1, 10)
            list(lines)
    assert wait_for(lambda: all(n.reported_requests == 0 for n in nodes), 10)
