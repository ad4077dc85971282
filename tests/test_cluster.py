"""The disaggregated cluster on CPU: Ray local actors, KV over gloo, the router behind the HTTP
API. A tiny random model keeps it fast; tests/test_default_model_parity.py runs the real one."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from cluster_helpers import launch, serve, wait_for
from tiny_models import CHAT_TEMPLATE, make_tiny_llama

from cluster.client import AsyncClient, Client
from engine import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = [
    "hello there",
    "a",
    "the quick brown fox jumps",
    "1 2 3 4 5 6 7 8 9 10",
    "lorem ipsum dolor sit amet, consectetur adipiscing elit",
    "zzz",
    "cluster",
    "tokens!",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-cluster")
    make_tiny_llama(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


ENGINE = dict(max_model_len=512, kv_cache_tokens=4096, max_num_seqs=32)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    cluster = launch(tiny_model, prefill=2, decode=2, **ENGINE)
    server = serve(cluster)
    yield cluster, server
    server.stop()
    cluster.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, device="cpu", **ENGINE)


def test_disaggregated_greedy_equals_offline_engine(cluster, offline):
    _, server = cluster
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = offline.generate(PROMPTS, params)
    with Client(server.url) as client:
        for prompt, ref in zip(PROMPTS, expected):
            out = client.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
            assert out.token_ids == ref.token_ids
            assert out.text == ref.text


def test_seeded_sampling_equals_offline_engine(cluster, offline):
    _, server = cluster
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    [expected] = offline.generate([PROMPTS[2]], params)
    with Client(server.url) as client:
        out = client.generate(
            PROMPTS[2], max_tokens=16, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True
        )
    assert out.token_ids == expected.token_ids


def test_64_concurrent_streams_complete_and_free_every_pool(cluster, offline):
    cluster_, server = cluster
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(64)]
    expected = offline.generate(prompts, params)

    async def run_all():
        async with AsyncClient(server.url, timeout=300) as client:

            async def one(prompt):
                ids, finish = [], None
                stream = await client.generate(
                    prompt, max_tokens=12, temperature=0, ignore_eos=True, stream=True
                )
                async for chunk in stream:
                    ids += chunk.token_ids
                    finish = chunk.finish_reason or finish
                return ids, finish

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run_all())
    for (ids, finish), ref in zip(results, expected):
        assert finish == "length"
        assert ids == ref.token_ids
    assert wait_for(cluster_.kv_pools_empty, 30)
    stats = cluster_.node_stats()
    used = {s["node"] for s in stats if s.get("prompts_done") or s.get("tokens_out")}
    assert used == {"prefill-0", "prefill-1", "decode-0", "decode-1"}


def test_client_disconnect_aborts_and_frees_kv_on_both_nodes(cluster):
    cluster_, server = cluster
    max_tokens = 480

    def decoded() -> int:
        return sum(s.get("tokens_out", 0) for s in cluster_.node_stats())

    before = decoded()
    body = {
        "model": cluster_.router.model_name,
        "prompt": "keep going",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line.startswith("data:"))
        # Leaving the block closes the connection mid-stream.
    assert wait_for(cluster_.kv_pools_empty, 30)
    # The decode node stopped early: the abort reached it, not the end of max_tokens.
    assert decoded() - before < max_tokens


def test_prompt_longer_than_context_is_a_400(cluster):
    _, server = cluster
    with httpx.Client(base_url=server.url) as http:
        response = http.post("/v1/completions", json={"prompt": "x" * 600, "max_tokens": 4})
    assert response.status_code == 400
    assert "context" in response.json()["error"]["message"]


def test_openai_package_against_the_cluster(cluster, offline):
    openai = pytest.importorskip("openai")
    cluster_, server = cluster
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(
        model=cluster_.router.model_name, messages=messages, max_tokens=8, temperature=0
    )
    [expected] = offline.chat([messages], SamplingParams(max_tokens=8, temperature=0))
    assert reply.choices[0].message.content == expected.text
    chunks = client.chat.completions.create(
        model=cluster_.router.model_name,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text


def test_health_lists_every_node(cluster):
    _, server = cluster
    with Client(server.url) as client:
        health = client.health()
    assert health["status"] == "ok"
    assert {n["name"] for n in health["nodes"]} == {
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
    }


def test_a_dead_decode_node_ends_its_requests_with_an_error_naming_it(tiny_model):
    cluster = launch(tiny_model, prefill=1, decode=2, **ENGINE)
    server = serve(cluster)
    try:
        body = {
            "model": cluster.router.model_name,
            "prompt": "stream",
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        outcomes: list[str] = []
        started = threading.Barrier(7)

        def stream_one() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    first = True
                    for line in response.iter_lines():
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
        assert not any(t.is_alive() for t in threads), "a stream hung after its node died"
        errors = [o for o in outcomes if o.startswith("error:")]
        assert errors and all("decode-0" in e for e in errors)
        assert len(outcomes) == 6
        # The survivor keeps serving.
        with Client(server.url) as client:
            out = client.generate("after", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4
            # Down until its replacement serves (cluster.control.supervisor), then back.
            health = client.health()
            node = next(n for n in health["nodes"] if n["name"] == "decode-0")
            replaced = node["status"] == "ok" and node["restarts"] == 1
            down = node["status"] in ("down", "restarting") and health["status"] == "degraded"
            assert down or replaced, health
    finally:
        server.stop()
        cluster.shutdown()


def test_shutdown_lets_every_node_exit_on_its_own(tiny_model, monkeypatch):
    """After it shuts down, a node's process exits by itself (its atexit handlers run, and no
    signal from Ray lands in its cleanup), and it is gone when `shutdown` returns: none is
    killed."""
    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: killed.append(actor))
    cluster = launch(tiny_model, prefill=1, decode=1, **ENGINE)
    nodes = cluster.prefill_actors + cluster.decode_actors
    assert len(nodes) == 2
    cluster.shutdown()
    assert killed == []
    for node in nodes:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(node.ping.remote(), timeout=10)
