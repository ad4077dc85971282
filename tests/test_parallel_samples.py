"""Parallel samples of one prompt (`SamplingParams(n=N)` on the offline engine) share one
prefill: the first sample prefills the prompt, the others take its prompt KV (the same slots,
shared) and draw their first token from its logits. Each sample's tokens are those it draws
alone; the prompt is prefilled once; slots are freed when their last holder lets go, also
through retraction, abort, chunks and speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.scheduling.allocator import SlotAllocator

SPEC = "multi-layer-eagle"
SAMPLED = SamplingParams(n=4, max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("parallel_samples")
    make_tiny_llama(root / "tiny", seed=0)
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.01)
    return root / "tiny", root / "target", root / "draft"


def _llm(model: Path, draft: Path | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    if draft is not None:
        kw.update(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_steps=3)
    return LLM(str(model), device="cpu", **kw)


PROMPTS = [[3 + (5 * i + j) % 250 for j in range(9 + 7 * i)] for i in range(3)]


def _alone(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    """Each sample as a prompt of its own (no sharing): what the samples must draw."""
    each = [params.for_sample(s) for _ in prompts for s in range(params.n)]
    repeated = [p for p in prompts for _ in range(params.n)]
    return [o.token_ids for o in llm.generate(repeated, each)]


def _prefilled_tokens(llm: LLM) -> list[int]:
    """Counts the tokens every prefill forward runs (chunks included)."""
    counted: list[int] = []
    runner = llm.engine.runner
    build_batch = runner.build_batch

    def counting(requests, ends=None):
        batch = build_batch(requests, ends)
        if ends is not None:
            counted.append(sum(batch.extend_lens))
        return batch

    runner.build_batch = counting
    return counted


def _clean(llm: LLM) -> bool:
    engine = llm.engine
    engine.kv_cache.kv_pool.allocator.check_integrity()
    speculator = engine.speculator
    return engine.kv_cache.is_empty() and (speculator is None or speculator.is_empty())


def test_samples_draw_what_they_draw_alone_from_one_prefill(models):
    tiny, *_ = models
    # Without the prefix cache: the samples run alone first would leave their prompts cached.
    llm = _llm(tiny, enable_prefix_cache=False)
    expected = _alone(llm, PROMPTS, SAMPLED)
    counted = _prefilled_tokens(llm)
    outputs = llm.generate(PROMPTS, SAMPLED)
    assert [o.token_ids for o in outputs] == expected
    # Samples differ from each other, and each prompt was prefilled once.
    assert len({tuple(t) for t in expected[:4]}) > 1
    assert sum(counted) == sum(len(p) for p in PROMPTS)
    assert _clean(llm)


def test_samples_share_the_prompts_slots_until_each_has_its_own_tokens(models):
    tiny, *_ = models
    engine = _llm(tiny).engine
    prompt = PROMPTS[2]
    samples = [engine.make_request(str(s), prompt, SAMPLED.for_sample(s)) for s in range(SAMPLED.n)]
    engine.add_samples(samples)
    engine.step()
    allocator = engine.kv_cache.kv_pool.allocator
    # One copy of the prompt's KV, four rows reading it, four first tokens.
    assert allocator.num_used == len(prompt)
    assert len({tuple(s.slots) for s in samples}) == 1
    assert len({s.row for s in samples}) == SAMPLED.n
    assert all(len(s.output_token_ids) == 1 for s in samples)
    engine.step()  # each sample's own slot for its newest token
    assert allocator.num_used == len(prompt) + SAMPLED.n
    while engine.has_work():
        engine.step()
    assert engine.kv_cache.is_empty()


def test_speculating_samples_draw_what_they_draw_alone(models):
    """Seeded speculative sampling draws per position; sharing the prompt changes nothing."""
    _, target, draft = models
    params = SamplingParams(n=3, max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)
    alone = _alone(_llm(target, draft), PROMPTS, params)
    llm = _llm(target, draft)
    counted = _prefilled_tokens(llm)
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == alone
    assert all(o.usage.spec_verify_steps for o in outputs)
    assert sum(counted) == sum(len(p) for p in PROMPTS)
    assert _clean(llm)


def test_samples_survive_retraction_and_chunks(models):
    """A pool too small for every sample at once retracts some (each re-prefills alone), and
    a prompt longer than the chunk size shares its KV once its last chunk ran."""
    tiny, *_ = models
    params = SamplingParams(n=4, max_tokens=40, temperature=0.9, seed=11, ignore_eos=True)
    prompts = [[3 + (7 * j) % 250 for j in range(60)]]
    expected = _alone(_llm(tiny), prompts, params)
    llm = _llm(tiny, kv_cache_tokens=160, chunked_prefill_size=16)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.num_retractions > 0
    assert _clean(llm)


def test_aborting_the_first_sample_before_its_prefill_hands_the_prompt_to_the_next(models):
    tiny, *_ = models
    llm = _llm(tiny)
    engine = llm.engine
    prompt = PROMPTS[1]
    samples = [
        engine.make_request(f"s{s}", prompt, SAMPLED.for_sample(s)) for s in range(SAMPLED.n)
    ]
    expected = _alone(_llm(tiny), [prompt], SAMPLED)
    engine.add_samples(samples)
    assert engine.scheduler.abort("s0") is samples[0]
    assert engine.scheduler.abort("s2") is samples[2]
    while engine.has_work():
        engine.step()
    assert samples[0].finish_reason == samples[2].finish_reason == "abort"
    assert not samples[2].output_token_ids
    assert samples[1].output_token_ids == expected[1]
    assert samples[3].output_token_ids == expected[3]
    assert _clean(llm)


def test_a_shared_slot_is_free_only_once_every_holder_let_go():
    allocator = SlotAllocator(8)
    slots = allocator.allocate(3)
    allocator.share(slots)
    allocator.share(slots[:2])
    allocator.free(slots)
    assert allocator.num_used == 3
    allocator.free(slots)
    assert allocator.num_used == 2
    allocator.free(slots[:2])
    assert allocator.num_used == 0 and allocator.num_free == 8
    allocator.check_integrity()
    with pytest.raises(ValueError, match="shared but not allocated"):
        allocator.share([5])


def test_more_samples_than_max_num_seqs_share_a_prefill_per_group(models):
    """n above max_num_seqs: a group of samples runs at once or not at all, so the samples are
    split into groups of at most max_num_seqs, each sharing one prefill (one group larger
    than max_num_seqs would never be admitted)."""
    tiny, *_ = models
    llm = _llm(tiny, max_num_seqs=3, enable_prefix_cache=False)  # as above
    params = SamplingParams(n=7, max_tokens=5, temperature=0.9, seed=11, ignore_eos=True)
    expected = _alone(llm, PROMPTS[:1], params)
    counted = _prefilled_tokens(llm)
    outputs = llm.generate(PROMPTS[:1], params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(counted) == 3 * len(PROMPTS[0])  # groups of 3, 3 and 1
    assert _clean(llm)


def test_speculating_samples_share_each_depths_prompt_kv(models):
    """Every depth keeps one copy of the prompt's draft KV too: a sample's draft reads the
    first sample's up to the positions its own first token changes (depth d: n - 1 - d), so
    pools as large as the target's, which holds the prompt once, fit every depth."""
    _, target, draft = models
    prompt = [3 + (7 * j) % 250 for j in range(60)]
    params = SamplingParams(n=4, max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    llm = _llm(target, draft)
    engine = llm.engine
    samples = [engine.make_request(str(s), prompt, params.for_sample(s)) for s in range(params.n)]
    engine.add_samples(samples)
    engine.step()
    depths = engine.speculator.depths
    for d, runner in enumerate(depths):
        first, *others = [s.spec_state.seqs[d] for s in samples]
        shared = len(prompt) - 1 - d
        assert all(seq.slots[:shared] == first.slots[:shared] for seq in others)
        assert all(seq.valid_len == first.valid_len == len(prompt) - d for seq in others)
        own = sum(len(seq.slots) - shared for seq in others)
        assert runner.kv_pool.allocator.num_used == len(first.slots) + own
    # Each sample drafts what it drafts alone: the same chain from the same boundary states.
    alone = _llm(target, draft).engine
    singles = [alone.make_request(str(s), prompt, params.for_sample(s)) for s in range(params.n)]
    for req in singles:
        alone.add_request(req)
    alone.step()
    for shared, single in zip(samples, singles):
        assert shared.output_token_ids == single.output_token_ids
        assert shared.spec_state.chain == single.spec_state.chain
        for mine, theirs in zip(shared.spec_state.boundary, single.spec_state.boundary):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    while engine.has_work():
        engine.step()
    assert _clean(llm)


@pytest.mark.parametrize("tree", [{}, {"speculative_topk": 3, "num_draft_tokens": 6}])
def test_speculating_samples_fit_draft_pools_as_small_as_the_targets(models, tree):
    """Four samples of a 60-token prompt in pools of 160 slots (a few more in each depth):
    four copies of the prompt would not fit a depth's pool, one does. Each sample draws what
    it draws alone, with a chain or a tree."""
    _, target, draft = models
    params = SamplingParams(n=4, max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    prompts = [[3 + (7 * j) % 250 for j in range(60)]]
    expected = _alone(_llm(target, draft, **tree), prompts, params)
    llm = _llm(target, draft, kv_cache_tokens=160, max_num_seqs=4, **tree)
    assert all(depth.kv_pool.capacity < 4 * 60 for depth in llm.engine.speculator.depths)
    outputs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outputs] == ["length"] * 4
    assert [o.token_ids for o in outputs] == expected
    assert all(o.usage.spec_verify_steps for o in outputs)
    assert _clean(llm)


def test_speculating_samples_run_their_pools_full_without_a_draft_running_short(models):
    """Four samples of a 60-token prompt and 30 tokens each fill a pool of 160 slots, and one
    is retracted. A sample's own positions in depth d start d + 1 before its own in the
    target, which the depths' pools make room for: no draft extend runs out of slots."""
    _, target, draft = models
    params = SamplingParams(n=4, max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)
    prompts = [[3 + (7 * j) % 250 for j in range(60)]]
    expected = _alone(_llm(target, draft), prompts, params)
    llm = _llm(target, draft, kv_cache_tokens=160, max_num_seqs=4)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_retractions > 0
    assert _clean(llm)
