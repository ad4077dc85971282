"""The prefix cache in a speculating engine (spec/runtime/prefix_drafts.py): every draft depth's KV
is cached with the target's, a match gives up the positions whose draft KV read tokens past it, and
greedy output and the drafts' acceptance with the cache equal those without it (chains, a tree,
chunked prefill, parallel samples, a pool small enough to evict). Every used slot of every pool is
held by a request or the cache, and the pools hold only the cache's at the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from prefix_prompts import shared_prefix_prompts
from tiny_drafts import make_good_draft, make_predictable_llama

from engine import LLM, SamplingParams
from engine.kernels import triton_runs_on
from metadata.kv_audit import request_pools

K = 2
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prefix_spec")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", K, noise=0.01)
    return root / "target", root / "draft"


def _llm(models, cache: bool, **kw) -> LLM:
    target, draft = models
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("device", "cpu")
    return LLM(
        str(target),
        enable_prefix_cache=cache,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        num_draft_steps=K,
        **kw,
    )


def _shared_prefix_prompts(seed: int, groups: int = 2, per_group: int = 3) -> list[list[int]]:
    return shared_prefix_prompts(seed, groups, per_group)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    """Each prompt on its own (so that later ones find the earlier ones' prefixes), then two
    conversation turns that resend the history with the engine's answers."""
    outputs = [llm.generate([p], params)[0] for p in prompts]
    rng = random.Random(5)
    histories = [list(p) + o.token_ids for p, o in zip(prompts[:4], outputs)]
    for _ in range(2):
        histories = [h + [rng.randrange(3, 320) for _ in range(3)] for h in histories]
        turn = llm.generate(histories, params)
        outputs += turn
        histories = [h + o.token_ids for h, o in zip(histories, turn)]
    return outputs


def _drafts_held_by_the_cache_alone(llm: LLM) -> None:
    engine = llm.engine
    speculator = engine.speculator
    assert engine.kv_cache.is_empty() and speculator.is_empty()
    used = engine.kv_cache.kv_pool.allocator.num_used
    pools = request_pools(used, [], speculator, cached=engine.kv_cache.cached_slots())
    assert all(p.used == p.held for p in pools), pools
    # At most one slot in every depth for each cached target position (none for the first K
    # positions of a path, whose slots key no draft KV).
    assert len({p.used for p in pools[1:]}) == 1 and 0 < pools[1].used < used


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"chunked_prefill_size": 8},
        {"speculative_topk": 2, "num_draft_tokens": 4},
        {"kv_cache_tokens": 160, "max_num_seqs": 2},
    ],
    ids=["chain", "chunked", "tree", "evicting"],
)
def test_output_and_acceptance_with_the_cache_equal_those_without(models, options):
    prompts = _shared_prefix_prompts(seed=1)
    results = {}
    for cache in (False, True):
        llm = _llm(models, cache, **options)
        outputs = _run(llm, prompts)
        results[cache] = (
            [o.token_ids for o in outputs],
            [o.usage.spec_accepted_per_position for o in outputs],
        )
        if cache:
            cached = [o.usage.cached_tokens for o in outputs]
            assert sum(cached) > 0, "later prompts start at their group's cached prefix"
            _drafts_held_by_the_cache_alone(llm)
            if "kv_cache_tokens" in options:
                assert llm.engine.kv_cache.prefix_cache.evicted_tokens > 0
        else:
            assert llm.engine.kv_cache.prefix_cache is None or not any(
                o.usage.cached_tokens for o in outputs
            )
    assert results[True] == results[False]


def test_the_output_equals_plain_decoding(models):
    target, _ = models
    prompts = _shared_prefix_prompts(seed=2, groups=2, per_group=3)
    plain = LLM(str(target), device="cpu", kv_cache_tokens=4096, enable_prefix_cache=False)
    expected = [o.token_ids for o in _run(plain, prompts)]
    assert [o.token_ids for o in _run(_llm(models, True), prompts)] == expected


def test_a_match_gives_up_the_positions_whose_draft_read_past_it(models):
    llm = _llm(models, True)
    system = list(range(10, 40))
    llm.generate([system + [50, 51]], GREEDY)
    second = llm.generate([system + [60, 61, 62]], GREEDY)[0]
    # The first request cached its prompt and its answer; the second matches the 30 system
    # tokens and uses all but the last K, whose draft KV read the first's own tokens after them.
    assert second.usage.cached_tokens == len(system) - K
    again = llm.generate([system + [60, 61, 62]], GREEDY)[0]
    assert again.token_ids == second.token_ids
    assert again.usage.cached_tokens == len(system) + 3 - 1 - K
    _drafts_held_by_the_cache_alone(llm)


def _prefill(llm: LLM, prompt: list[int]):
    engine = llm.engine
    req = engine.make_request("probe", prompt, GREEDY)
    engine.add_request(req)
    engine.step()  # the prompt's prefill and the draft's first extend
    return req


def test_a_position_where_cached_paths_part_serves_only_the_path_its_draft_read(models):
    """The tree holds a shared opening once for every path through it, but the draft KV of its
    last positions read the tokens of the request that computed them: a request that parts from
    that path there reads the cache only up to where its own tokens differ."""
    llm = _llm(models, True)
    common = list(range(10, 30))
    llm.generate([common + [50, 51, 52, 53, 54, 55]], GREEDY)
    [other] = llm.generate([common + [60, 61, 62, 63, 64, 65]], GREEDY)
    prompt = common + [60, 61, 62, 63, 64, 65] + other.token_ids + [70]
    ours = _prefill(llm, prompt)
    # Past the common opening, through the second path.
    assert ours.cached_tokens > len(common)
    reference = _llm(models, False)
    fresh = _prefill(reference, prompt)
    assert ours.spec_state.chain == fresh.spec_state.chain
    pairs = zip(llm.engine.speculator.depths, reference.engine.speculator.depths)
    for (mine, theirs), a, b in zip(pairs, ours.spec_state.seqs, fresh.spec_state.seqs):
        assert a.valid_len == b.valid_len
        for name in ("k_buffers", "v_buffers"):
            x = getattr(mine.kv_pool, name)[0][a.slots[: a.valid_len]]
            y = getattr(theirs.kv_pool, name)[0][b.slots[: b.valid_len]]
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_parallel_samples_share_a_cached_prefix(models):
    prompt = list(range(10, 40))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=3)
    outputs = {}
    for cache in (False, True):
        llm = _llm(models, cache)
        llm.generate([prompt + [7]], GREEDY)
        outputs[cache] = [o.token_ids for o in llm.generate([prompt + [8, 9]], params)]
        if cache:
            _drafts_held_by_the_cache_alone(llm)
    assert outputs[True] == outputs[False]


def test_an_aborted_request_lets_go_of_its_cached_prefix(models):
    llm = _llm(models, True)
    engine = llm.engine
    system = list(range(10, 40))
    llm.generate([system + [50]], GREEDY)
    req = engine.make_request("r", system + [60, 61], GREEDY)
    engine.add_request(req)
    engine.step()  # its prefill, from the cached prefix
    assert req.cached_tokens == len(system) - K and req.spec_state is not None
    assert engine.abort("r") is req
    while engine.has_work():
        engine.step()
    _drafts_held_by_the_cache_alone(llm)


def test_a_request_that_does_not_speculate_reads_the_targets_cached_kv_alone(models):
    llm = _llm(models, True)
    system = list(range(10, 40))
    llm.generate([system + [50]], GREEDY)
    prompt = system + [60, 61]
    [plain] = llm.generate([prompt], GREEDY, speculative=False)
    assert plain.usage.cached_tokens == len(system) - K
    assert plain.token_ids == llm.generate([prompt], GREEDY)[0].token_ids
    _drafts_held_by_the_cache_alone(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
@pytest.mark.parametrize("options", [{}, {"speculative_topk": 2, "num_draft_tokens": 4}])
def test_output_with_the_cache_on_a_gpu(models, options):
    """The GPU's defaults (Triton attention, CUDA graphs for the target's and the drafts'
    steps, device-queued verifies), in float32: a draft extend that starts at a cached prefix
    runs as one that starts at a prompt's beginning."""
    prompts = _shared_prefix_prompts(seed=3)
    results = {}
    for cache in (False, True):
        llm = _llm(models, cache, device="cuda", dtype="float32", max_num_seqs=8, **options)
        assert llm.config.cuda_graph_max_bs
        outputs = _run(llm, prompts)
        results[cache] = [o.token_ids for o in outputs]
        if cache:
            assert sum(o.usage.cached_tokens for o in outputs) > 0
            _drafts_held_by_the_cache_alone(llm)
    assert results[True] == results[False]


@pytest.mark.parametrize("options", [{}, {"speculative_topk": 2, "num_draft_tokens": 4}])
def test_a_turn_finds_the_answer_before_it_cached(models, options):
    """A finished request gives the cache its answer's positions too, each depth's KV with the
    target's: the next turn of the conversation starts past them."""
    llm = _llm(models, True, **options)
    prompt = list(range(10, 40))
    first = llm.generate([prompt], GREEDY)[0]
    history = prompt + first.token_ids + [70, 71]
    second = llm.generate([history], GREEDY)[0]
    # All the first request computed (its last token's KV never was) but the last K positions,
    # whose draft KV read tokens after them.
    assert second.usage.cached_tokens == len(prompt) + len(first.token_ids) - 1 - K
    fresh = _llm(models, False, **options).generate([history], GREEDY)[0]
    assert second.token_ids == fresh.token_ids
    assert second.usage.spec_accepted_per_position == fresh.usage.spec_accepted_per_position
    _drafts_held_by_the_cache_alone(llm)
