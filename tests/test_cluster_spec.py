"""Speculative decoding through the disaggregated cluster: the prefill node drafts over the
prompt and sends every depth's KV and the chain; the decode node verifies it first, then
drafts, verifies and extends, with alternative chains from its first draft extend on where it
drafts several. Greedy output must equal the target alone."""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import launch, wait_for
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft

from engine import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40)), [5] * 23, [7], [9, 9]]
ENGINE = dict(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster_spec")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "good", root / "target", 4, noise=0.01)
    make_random_draft(root / "random", root / "target", 4, seed=1)
    return root


@pytest.fixture(scope="module")
def reference(folders):
    llm = LLM(str(folders / "target"), device="cpu", **ENGINE)
    return {
        max_tokens: [
            out.token_ids
            for out in llm.generate(
                PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            )
        ]
        for max_tokens in (1, 2, 20)
    }


async def _run(router, max_tokens: int) -> list[tuple[list[int], dict]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int, prompt: list[int]):
        tokens, usage = [], None
        async for delta in router.generate(f"r{i}", prompt, params):
            tokens += delta.token_ids
            usage = delta.usage or usage
        return tokens, usage

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


@pytest.mark.parametrize(
    ("draft", "num_draft_steps", "prefill", "decode", "shape"),
    [
        ("good", 3, 2, 2, {}),
        ("good", 1, 1, 1, {}),
        ("random", 4, 1, 1, {}),
        ("random", 3, 1, 1, {"num_draft_chains": 3}),
        ("good", 3, 1, 1, {"speculative_topk": 3, "num_draft_tokens": 7}),
    ],
)
def test_speculative_cluster_is_lossless(
    folders, reference, draft, num_draft_steps, prefill, decode, shape
):
    cluster = launch(
        str(folders / "target"),
        prefill=prefill,
        decode=decode,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(folders / draft),
        num_draft_steps=num_draft_steps,
        **shape,
        **ENGINE,
    )
    try:

        async def all_lengths():
            # All at once: requests that speculate (max_tokens 20) share the decode nodes'
            # batches with requests that cannot (one token left after the first: none drafted).
            lengths = (20, 2, 1)
            try:
                runs = await asyncio.gather(*(_run(cluster.router, m) for m in lengths))
            finally:
                await cluster.router.close()
            return dict(zip(lengths, runs))

        results = asyncio.run(all_lengths())
        for max_tokens, outputs in results.items():
            for (tokens, usage), expected in zip(outputs, reference[max_tokens]):
                assert tokens == expected
                if max_tokens == 20:
                    details = usage["completion_tokens_details"]
                    assert usage["spec_verify_steps"] >= 1
                    proposed = (
                        details["accepted_prediction_tokens"]
                        + details["rejected_prediction_tokens"]
                    )
                    assert proposed >= usage["spec_verify_steps"]
                    if shape:  # the decode node verified trees after the first step
                        assert proposed > num_draft_steps * usage["spec_verify_steps"]
        accepted = sum(
            u["completion_tokens_details"]["accepted_prediction_tokens"] for _, u in results[20]
        )
        if draft == "good":
            assert accepted > len(PROMPTS)  # the good draft's chains are mostly accepted
        stats = [s for s in cluster.node_stats() if s["node"].startswith("decode")]
        assert sum(s["spec_verify_steps"] for s in stats) > 0
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()


def test_prompt_embeddings_cross_the_cluster_and_reach_the_draft(folders):
    """A request that gives embeddings for some prompt positions: the prefill node's target
    and draft read them, and the speculative output equals the offline engine's."""
    import torch

    from engine.executor.prompt_embeds import PromptEmbeds

    target = str(folders / "target")
    offline = LLM(target, device="cpu", **ENGINE)
    hidden = offline.model_config.hidden_size
    vectors = {
        2: torch.randn(hidden, generator=torch.Generator().manual_seed(1)).tolist(),
        # The tiny target's next token depends mostly on the current one: the last position
        # carries the vector that visibly changes the answer.
        7: offline.engine.runner.model.model.embed_tokens.weight[77].tolist(),
    }
    prompt = [1, 17, 0, 4, 250, 6, 8, 0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    [expected] = offline.generate([prompt], params, prompt_embeds=vectors)
    [placeholder] = offline.generate([prompt], params)
    assert expected.token_ids != placeholder.token_ids  # the vectors really matter

    cluster = launch(
        target,
        prefill=1,
        decode=1,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(folders / "good"),
        num_draft_steps=3,
        **ENGINE,
    )
    try:

        async def one():
            tokens = []
            try:
                embeds = PromptEmbeds.of(vectors)
                cluster.router.validate(prompt, params, embeds)
                async for delta in cluster.router.generate("e", prompt, params, embeds):
                    tokens += delta.token_ids
            finally:
                await cluster.router.close()
            return tokens

        assert asyncio.run(one()) == expected.token_ids
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("kind", ["hc_mult=2", "eagle3 aux layers 0,1,2"])
def test_wide_draft_inputs_cross_the_cluster(tmp_path, kind):
    """spec_hidden_size wider than hidden_size end to end through Ray actors: the metadata rows
    both nodes allocate are that wide, and the output is the target's alone."""
    from tiny_drafts import make_copying_draft, make_predictable_deep_llama
    from tiny_models import make_tiny_hyper_llama

    target, draft = tmp_path / "target", tmp_path / "draft"
    if kind.startswith("hc"):
        make_tiny_hyper_llama(target)
        make_copying_draft(draft, target, 2, noise=0.01)
        factor = 2
    else:
        make_predictable_deep_llama(target, num_layers=3)
        make_copying_draft(draft, target, 2, noise=0.01, aux_layers=(0, 1, 2))
        factor = 3
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    offline = LLM(str(target), device="cpu", **ENGINE)
    expected = [o.token_ids for o in offline.generate(PROMPTS, params)]
    cluster = launch(
        str(target),
        prefill=1,
        decode=1,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        num_draft_steps=2,
        **ENGINE,
    )
    try:
        widths = [
            ray.get(a.describe.remote())["spec"]["spec_hidden_size"]
            for a in cluster.prefill_actors + cluster.decode_actors
        ]
        assert widths == [factor * offline.model_config.hidden_size] * 2

        async def run():
            try:
                return await _run(cluster.router, 12)
            finally:
                await cluster.router.close()

        assert [tokens for tokens, _ in asyncio.run(run())] == expected
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()
