"""The prefix cache in the offline engine: greedy output with the cache equals output without
it (shared system prompts, multi-turn conversations whose next turn resends the history,
chunked prefill, overlap, parallel samples, a pool small enough to evict and retract); what
it saves is counted (hits, prefill tokens, usage's cached_tokens); an aborted request lets go
of its prefix; the KV audit finds every used slot held by a request or the cache at every
step of a run with aborts. A speculating engine's: tests/test_prefix_cache_spec.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prefix_prompts import shared_prefix_prompts

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.kernels import triton_runs_on
from metadata.kv_audit import request_pools

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _llm(path: Path, cache: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLM(str(path), device="cpu", enable_prefix_cache=cache, **kw)


def _conversations(llm: LLM, firsts: list[list[int]], turns: int, seed: int) -> list[list[int]]:
    """Each conversation's turns, each resending the history with the engine's own answers;
    returns every turn's output tokens, turn by turn."""
    rng = random.Random(seed)
    histories = [list(p) for p in firsts]
    outputs = []
    for _ in range(turns):
        answers = llm.generate(histories, GREEDY)
        outputs += [a.token_ids for a in answers]
        histories = [
            h + a.token_ids + [rng.randrange(3, 320) for _ in range(rng.randint(1, 6))]
            for h, a in zip(histories, answers)
        ]
    return outputs


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"chunked_prefill_size": 8},
        {"chunked_prefill_size": 8, "mixed_prefill": False, "max_num_seqs": 3},
        {"overlap_schedule": True, "max_num_seqs": 4},
    ],
    ids=["whole", "chunked", "chunked-unmixed", "overlap"],
)
def test_greedy_output_with_the_cache_equals_output_without_it(tiny_model_path, options):
    prompts = shared_prefix_prompts(seed=1)
    firsts = shared_prefix_prompts(seed=2, groups=2, per_group=3)
    results = {}
    for cache in (False, True):
        llm = _llm(tiny_model_path, cache, **options)
        shared = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        turns = _conversations(llm, firsts, turns=3, seed=3)
        results[cache] = (shared, turns, llm.engine.prefill_tokens)
        assert llm.engine.kv_cache.is_empty()
        if cache:
            kv_cache = llm.engine.kv_cache
            assert kv_cache.hit_tokens > 0 and kv_cache.prefix_cache.size > 0
    assert results[True][:2] == results[False][:2]
    assert results[True][2] < results[False][2]  # fewer tokens prefilled


def test_a_turn_reuses_the_whole_history_and_usage_says_so(tiny_model_path):
    llm = _llm(tiny_model_path, True)
    prompt = list(range(10, 40))
    [first] = llm.generate([prompt], GREEDY)
    assert first.usage.cached_tokens == 0
    follow_up = prompt + first.token_ids + [7, 8, 9]
    [second] = llm.generate([follow_up], GREEDY)
    # Every token whose KV the first turn computed: its prompt and all its answer but the last.
    assert second.usage.cached_tokens == len(prompt) + len(first.token_ids) - 1
    [again] = llm.generate([prompt], GREEDY)
    assert again.usage.cached_tokens == len(prompt) - 1 and again.token_ids == first.token_ids
    off = _llm(tiny_model_path, False)
    assert off.generate([follow_up], GREEDY)[0].token_ids == second.token_ids
    assert off.engine.kv_cache.prefix_cache is None and off.engine.kv_cache.hit_tokens == 0


def test_parallel_samples_with_the_cache(tiny_model_path):
    prompts = shared_prefix_prompts(seed=4, groups=2, per_group=2)
    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=3),
        SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True, n=2),
    ] * 2
    results = {}
    for cache in (False, True):
        llm = _llm(tiny_model_path, cache, chunked_prefill_size=8)
        results[cache] = [o.token_ids for o in llm.generate(prompts, params)]
        results[cache] += [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv_cache.is_empty()
    assert results[True] == results[False]


def test_a_full_pool_evicts_and_retracts_without_changing_output(tiny_model_path):
    prompts = shared_prefix_prompts(seed=5, groups=6, per_group=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for cache in (False, True):
        llm = _llm(tiny_model_path, cache, kv_cache_tokens=160, max_num_seqs=4)
        results[cache] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.num_retractions > 0
        assert llm.engine.kv_cache.is_empty()
        if cache:
            assert llm.engine.kv_cache.prefix_cache.evicted_tokens > 0
    assert results[True] == results[False]


def _add(engine: EngineCore, name: str, prompt: list[int], max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = engine.make_request(name, prompt, params)
    engine.add_request(req)
    return req


def test_an_aborted_request_releases_its_references(tiny_model_path):
    llm = _llm(tiny_model_path, True, chunked_prefill_size=8)
    engine = llm.engine
    cache = engine.kv_cache.prefix_cache
    prompt = list(range(20, 60))
    llm.generate([prompt], GREEDY)
    reader = _add(engine, "reader", prompt + [5, 6, 7])
    in_chunks = _add(engine, "chunks", list(range(100, 140)))
    engine.step()
    assert reader.cached_len > 0 and cache.evictable_size < cache.size  # held while it runs
    engine.step()
    assert in_chunks.kv_len > 0 and not in_chunks.finished
    assert engine.abort("reader") is reader and engine.abort("chunks") is in_chunks
    assert reader.cache_node is None and in_chunks.cache_node is None
    assert cache.evictable_size == cache.size  # no holds left
    assert not engine.has_work() and engine.kv_cache.is_empty()


def test_the_kv_audit_finds_no_mismatch_through_a_run_with_aborts(tiny_model_path):
    """At every step, the used slots are exactly those some live request or the cache holds."""
    llm = _llm(tiny_model_path, True, chunked_prefill_size=8, kv_cache_tokens=300)
    engine = llm.engine
    rng = random.Random(6)
    prompts = shared_prefix_prompts(seed=6, groups=4, per_group=5)
    live = []
    for i, prompt in enumerate(prompts):
        live.append(_add(engine, f"r{i}", prompt, max_tokens=rng.randint(2, 16)))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps % 3 == 0:
            running = [r for r in live if not r.finished]
            if running:
                engine.abort(rng.choice(running).request_id)
        live = [r for r in live if not r.finished]
        pools = request_pools(
            engine.kv_cache.kv_pool.allocator.num_used,
            live,
            None,
            cached=engine.kv_cache.cached_slots(),
        )
        assert [p for p in pools if p.used != p.held] == []
    assert engine.kv_cache.hit_tokens > 0 and engine.kv_cache.is_empty()


def test_a_multi_turn_soak_with_aborts_keeps_every_slot_accounted_for(tiny_model_path):
    """Conversations whose next turn resends the history as soon as the last one ends, some
    turns aborted on the way, in a pool small enough to evict and retract: at every step the
    used slots are exactly those held by live requests and the cache, and the tree keeps its
    invariants."""
    llm = _llm(tiny_model_path, True, chunked_prefill_size=16, kv_cache_tokens=400)
    engine = llm.engine
    rng = random.Random(11)
    system = [rng.randrange(3, 320) for _ in range(24)]
    histories = {c: system + [rng.randrange(3, 320) for _ in range(4)] for c in range(12)}
    live: dict[int, object] = {}
    served = aborted = steps = 0
    while served < 500:
        for conversation, history in histories.items():
            if conversation not in live:
                name = f"c{conversation}-{served}"
                live[conversation] = _add(engine, name, history, max_tokens=rng.randint(1, 10))
                served += 1
        engine.step()
        steps += 1
        if steps % 5 == 0:
            conversation = rng.choice(list(live))
            engine.abort(live[conversation].request_id)
            aborted += 1
        for conversation, req in list(live.items()):
            if req.finished:
                del live[conversation]
                answer = req.output_token_ids if req.finish_reason != "abort" else []
                turn = [rng.randrange(3, 320) for _ in range(rng.randint(1, 5))]
                histories[conversation] = (req.prompt_token_ids + answer + turn)[-200:]
        pools = request_pools(
            engine.kv_cache.kv_pool.allocator.num_used,
            list(live.values()),
            None,
            cached=engine.kv_cache.cached_slots(),
        )
        assert [p for p in pools if p.used != p.held] == [], steps
        engine.kv_cache.prefix_cache.check_integrity()
    while engine.has_work():
        engine.step()
    stats = engine.kv_cache.prefix_cache_stats()
    assert aborted > 40 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_evicted_tokens"] > 0 and engine.kv_cache.is_empty()


def test_the_audit_counts_the_cached_slots(tiny_model_path):
    llm = _llm(tiny_model_path, True)
    llm.generate(shared_prefix_prompts(seed=7, groups=1), GREEDY)
    used = llm.engine.kv_cache.kv_pool.allocator.num_used
    assert used > 0
    [without] = request_pools(used, [], None)
    assert without.held == 0  # the cache's slots would read as leaked
    [counted] = request_pools(used, [], None, cached=llm.engine.kv_cache.cached_slots())
    assert counted.held == used


def test_a_request_that_starts_past_a_cached_prefix_still_traces_its_prefill(tiny_model_path):
    llm = _llm(tiny_model_path, True, enable_tracing=True, chunked_prefill_size=8)
    prompt = list(range(10, 40))
    llm.generate([prompt], GREEDY)
    [again] = llm.generate([prompt + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], GREEDY)
    assert again.usage.cached_tokens > 0
    names = [event[0] for event in again.trace]
    # Once, though its prompt ran in two chunks after the cached prefix.
    assert names.count("prefill_start") == 1 and names.count("prefill_end") == 1
    # prefill_end says how much of the prompt came from the cache.
    [end] = [event for event in again.trace if event[0] == "prefill_end"]
    assert end[2] == {"cached_tokens": again.usage.cached_tokens}


@pytest.mark.gpu
@pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_output_with_the_cache_on_a_gpu(tiny_model_path, chunk):
    """The GPU's defaults (Triton attention, CUDA graphs for decode and prefill steps, overlap),
    in float32: a hit's span after the cached prefix runs in a prefill graph like a chunk."""
    prompts = shared_prefix_prompts(seed=8)
    firsts = shared_prefix_prompts(seed=9, groups=2, per_group=3)
    results = {}
    for cache in (False, True):
        llm = LLM(
            str(tiny_model_path),
            device="cuda",
            dtype="float32",
            kv_cache_tokens=4096,
            max_num_seqs=8,
            chunked_prefill_size=chunk,
            enable_prefix_cache=cache,
        )
        assert llm.config.cuda_graph_max_bs and llm.config.cuda_graph_max_prefill_tokens
        shared = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        turns = _conversations(llm, firsts, turns=3, seed=10)
        results[cache] = (shared, turns)
        assert llm.engine.kv_cache.is_empty()
        assert (llm.engine.kv_cache.hit_tokens > 0) == cache
    assert results[True] == results[False]
