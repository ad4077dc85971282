"""Parallel samples of one prompt through the cluster share one prefill of it: the prefill node
runs the prompt once and its target KV crosses once (the decode node forks its slots for the
other samples), with speculation too, and an aggregated replica prefills it once. Each sample
stays a request of its own: the choices are the offline engine's, and aborting one leaves the
others running and every pool empty."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import openai
import pytest
from cluster_helpers import launch, launch_aggregated, serve, wait_for
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from metadata.wire import kv_nbytes

ray = pytest.importorskip("ray")

ENGINE = dict(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=16)
PROMPTS = ["hello there", "the quick brown fox jumps over"]
SPEC = dict(speculative_algorithm="multi-layer-eagle", num_draft_steps=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster_samples")
    make_tiny_llama(root / "tiny")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.01)
    return root


def _stats(cluster, role: str) -> list[dict]:
    return [s for s in cluster.node_stats() if s["node"].startswith(role)]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


async def collect(stream) -> tuple[list[int], dict | None]:
    """A sample's stream read to its end: its tokens and its last usage."""
    tokens, usage = [], None
    async for delta in stream:
        tokens += delta.token_ids
        usage = delta.usage or usage
    return tokens, usage


def test_samples_share_one_prefill_and_transfer_through_the_cluster(models):
    tiny = str(models / "tiny")
    offline = LLM(tiny, device="cpu", **ENGINE)
    params = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=17, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(PROMPTS, params)]
    prompt_lens = [len(offline.tokenizer.encode(p)) for p in PROMPTS]
    cluster = launch(tiny, prefill=1, decode=1, **ENGINE)
    server = serve(cluster)
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        model = api.models.list().data[0].id
        ask = dict(model=model, prompt=PROMPTS, n=3, max_tokens=10, temperature=0.9, seed=17)
        answer = api.completions.create(extra_body={"ignore_eos": True}, **ask)
        assert [c.index for c in answer.choices] == list(range(6))
        assert [_ids(c) for c in answer.choices] == expected
        assert len({tuple(t) for t in expected[:3]}) == 3  # the samples differ
        # Each prompt was prefilled once and its KV crossed once: 2 transfers carried target
        # KV, 4 only their samples' first tokens.
        (prefill,) = _stats(cluster, "prefill")
        assert prefill["prefill_tokens"] == sum(prompt_lens)
        assert prefill["prompts_done"] == len(PROMPTS)
        assert prefill["transfers"]["count"] == 6
        prompts_kv = sum(kv_nbytes(offline.engine.runner.kv_pool, n) for n in prompt_lens)
        assert prompts_kv <= prefill["transfers"]["bytes"] < 2 * prompts_kv  # not 3 times
        assert answer.usage.prompt_tokens == sum(prompt_lens)
        assert answer.usage.completion_tokens == 60

        stream = api.completions.create(
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **ask,
        )
        tokens: dict[int, list[int]] = {}
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                tokens.setdefault(choice.index, []).extend(_ids(choice))
        assert [tokens[i] for i in range(6)] == expected
        assert usage.completion_tokens == 60 and usage.prompt_tokens == sum(prompt_lens)
        # The prefill node's prefix cache holds the prompts now: each computes its last token
        # only (its whole KV still crosses), and usage counts each prompt's cached tokens once.
        assert _stats(cluster, "prefill")[0]["prefill_tokens"] == sum(prompt_lens) + len(PROMPTS)
        assert usage.prompt_tokens_details.cached_tokens == sum(n - 1 for n in prompt_lens)
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        server.stop()
        cluster.shutdown()


def test_speculating_samples_share_a_prefill_and_abort_alone(models):
    target, draft = str(models / "target"), str(models / "draft")
    offline = LLM(target, device="cpu", draft_model=draft, **SPEC, **ENGINE)
    prompt = [1, 17, 99, 4, 250, 31, 8, 40, 41]
    params = SamplingParams(n=3, max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate([prompt], params)]
    # Without the prefix cache, so that the prefill tokens count each group's prefills.
    cluster = launch(
        target, prefill=1, decode=1, draft_model=draft, enable_prefix_cache=False, **SPEC, **ENGINE
    )
    router = cluster.router

    async def run() -> tuple[list, list]:
        try:
            samples = [params.for_sample(s) for s in range(3)]
            streams = router.generate_samples(["a0", "a1", "a2"], prompt, samples)
            shared = await asyncio.gather(*(collect(s) for s in streams))
            # Abort sample 1 after its first tokens: the others run to max_tokens.
            long = [replace(p, max_tokens=120) for p in samples]
            streams = router.generate_samples(["b0", "b1", "b2"], prompt, long)
            first = await streams[1].__anext__()
            assert first.token_ids
            await streams[1].aclose()
            rest = await asyncio.gather(collect(streams[0]), collect(streams[2]))
            return shared, rest
        finally:
            await router.close()

    try:
        shared, rest = asyncio.run(run())
        assert [tokens for tokens, _ in shared] == expected
        assert all(usage["spec_verify_steps"] for _, usage in shared)
        assert [len(tokens) for tokens, _ in rest] == [120, 120]
        (prefill,) = _stats(cluster, "prefill")
        assert prefill["prefill_tokens"] == 2 * len(prompt)
        assert wait_for(cluster.kv_pools_empty, 30)
        (decode,) = _stats(cluster, "decode")
        # Sample 1 stopped early: the abort reached the decode node.
        assert decode["tokens_out"] < 16 * 3 + 120 * 3
    finally:
        cluster.shutdown()


def test_speculating_samples_hold_and_send_the_prompts_draft_kv_once(models):
    """Four samples of a 100-token prompt on nodes whose pools hold 256 positions: four
    copies of the prompt in each draft depth would never fit, and the samples would wait
    for room forever. Each depth holds the prompt once on both nodes, the carrier's transfer
    brings it, and the others' bring only the positions their own first token changes."""
    target, draft = str(models / "target"), str(models / "draft")
    engine = dict(ENGINE, kv_cache_tokens=256)
    offline = LLM(target, device="cpu", draft_model=draft, **SPEC, **engine)
    prompt = [3 + (7 * j) % 250 for j in range(100)]
    params = SamplingParams(n=4, max_tokens=16, temperature=0.8, seed=9, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate([prompt], params)]
    cluster = launch(target, prefill=1, decode=1, draft_model=draft, **SPEC, **engine)
    router = cluster.router

    async def run() -> list[tuple[list[int], dict | None]]:
        try:
            samples = [params.for_sample(s) for s in range(4)]
            streams = router.generate_samples([f"s{i}" for i in range(4)], prompt, samples)
            return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
        finally:
            await router.close()

    try:
        outcomes = asyncio.run(run())
        assert [tokens for tokens, _ in outcomes] == expected
        assert all(usage["spec_verify_steps"] for _, usage in outcomes)
        (prefill,) = _stats(cluster, "prefill")
        depths = [depth.kv_pool for depth in offline.engine.speculator.depths]
        target_kv = kv_nbytes(offline.engine.runner.kv_pool, len(prompt))
        depths_kv = sum(kv_nbytes(pool, len(prompt)) for pool in depths)
        tails = sum(kv_nbytes(pool, d + 1) for d, pool in enumerate(depths))
        sent = prefill["transfers"]["bytes"]
        assert target_kv + depths_kv + 3 * tails <= sent < target_kv + depths_kv + 3 * tails * 2
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()


def test_an_aggregated_replica_prefills_the_samples_prompt_once(models):
    tiny = str(models / "tiny")
    offline = LLM(tiny, device="cpu", **ENGINE)
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3)
    expected = [o.token_ids for o in offline.generate(PROMPTS[1], params)]
    cluster = launch_aggregated(tiny, replicas=1, **ENGINE)
    server = serve(cluster)
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        model = api.models.list().data[0].id
        answer = api.completions.create(
            model=model, prompt=PROMPTS[1], n=4, max_tokens=8, temperature=1.0, seed=3
        )
        assert [_ids(c) for c in answer.choices] == expected
        (replica,) = _stats(cluster, "replica")
        assert replica["prefill_tokens"] == len(offline.tokenizer.encode(PROMPTS[1]))
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        server.stop()
        cluster.shutdown()
