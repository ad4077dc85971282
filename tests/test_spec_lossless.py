"""Speculative decoding is lossless: greedy outputs equal the target's alone, token for token,
for every number of draft depths, batch size and draft quality, with speculating and plain
requests in one engine, under stops, logprobs, seeds and preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams

SPEC = "multi-layer-eagle"
MAX_K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """draft kind -> (target folder, draft folder): a random draft on a tiny random Llama, and
    a good draft (accepts most tokens) on a target it nearly reproduces."""
    root = tmp_path_factory.mktemp("spec_lossless")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", MAX_K, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "good", root / "predictable", MAX_K, noise=0.01)
    return {
        "random": (root / "target", root / "random"),
        "good": (root / "predictable", root / "good"),
    }


def _llm(target: Path, draft: Path | None = None, k: int | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 8192)
    kw.setdefault("max_num_seqs", 32)
    if draft is not None:
        kw.update(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_steps=k)
    return LLM(str(target), device="cpu", **kw)


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1 to 60 tokens and answers of 1 to 30, so some requests end mid-chain."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 30), temperature=0, ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


_baselines: dict[tuple, list[list[int]]] = {}


def _baseline(target: Path, prompts, params, key: tuple) -> list[list[int]]:
    if key not in _baselines:
        _baselines[key] = [o.token_ids for o in _llm(target).generate(prompts, params)]
    return _baselines[key]


def _assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty()
    assert llm.engine.speculator.is_empty()


@pytest.mark.parametrize("batch_size", [1, 5, 32])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["random", "good"])
def test_greedy_output_equals_the_target_alone(models, kind: str, k: int, batch_size: int):
    target, draft = models[kind]
    prompts, params = _workload(batch_size, seed=batch_size)
    expected = _baseline(target, prompts, params, (kind, batch_size))
    llm = _llm(target, draft, k)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    _assert_clean(llm)
    if kind == "good":
        steps = sum(o.usage.spec_verify_steps for o in outputs)
        accepted = sum(
            o.usage.completion_tokens_details.accepted_prediction_tokens for o in outputs
        )
        assert accepted >= steps / 2, "the good draft should be accepted often"


@pytest.mark.parametrize("kind", ["random", "good"])
def test_speculating_and_plain_requests_share_an_engine(models, kind: str):
    target, draft = models[kind]
    prompts, params = _workload(12, seed=7)
    expected = _baseline(target, prompts, params, (kind, "mixed"))
    llm = _llm(target, draft, 3)
    flags = [i % 3 != 0 for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, speculative=flags)
    assert [o.token_ids for o in outputs] == expected
    for flag, out, p in zip(flags, outputs, params):
        if not flag:
            assert out.usage.spec_verify_steps is None
            assert out.usage.completion_tokens_details is None
        elif p.max_tokens > 1:
            assert out.usage.spec_verify_steps >= 1
    _assert_clean(llm)


def test_stops_inside_an_accepted_chain(models):
    """Stop tokens and EOS cut a verify step's tokens short; the output ends where the
    target's alone does, with the same finish reason."""
    target, draft = models["good"]
    prompts, _ = _workload(8, seed=3)
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = _llm(target)
    runs = plain.generate(prompts, free)
    # A token from the middle of each answer: the output must stop right after it.
    params = [
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[run.token_ids[7 + i % 5]])
        for i, run in enumerate(runs)
    ]
    expected = plain.generate(prompts, params)
    llm = _llm(target, draft, 4)
    outputs = llm.generate(prompts, params)
    for out, ref in zip(outputs, expected):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason == "stop"
        details = out.usage.completion_tokens_details
        assert details.accepted_prediction_tokens <= len(out.token_ids) - 1
    _assert_clean(llm)


def test_logprobs_match_the_target_alone(models):
    target, draft = models["good"]
    prompts, _ = _workload(4, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    expected = _llm(target).generate(prompts, params)
    outputs = _llm(target, draft, 3).generate(prompts, params)
    for out, ref in zip(outputs, expected):
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(ref.logprobs) == 12
        for ours, theirs in zip(out.logprobs, ref.logprobs):
            assert ours.token_id == theirs.token_id
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert [t for t, _ in ours.top_logprobs] == [t for t, _ in theirs.top_logprobs]


def test_seeded_sampling_of_plain_requests_is_unchanged_by_speculation(models):
    """A request that opts out draws every token from the same (seed, index) generator as in
    an engine without speculation, whatever speculating requests share its batch."""
    target, draft = models["good"]
    prompts, _ = _workload(6, seed=9)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=40 + i) for i in range(6)]
    expected = _llm(target).generate(prompts, params)
    llm = _llm(target, draft, 2)
    outputs = llm.generate(prompts, params, speculative=[i % 2 == 0 for i in range(6)])
    for i in range(1, 6, 2):
        assert outputs[i].token_ids == expected[i].token_ids


def test_seeded_speculative_sampling_is_reproducible(models):
    target, draft = models["good"]
    prompts, _ = _workload(5, seed=11)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i) for i in range(5)]
    llm = _llm(target, draft, 3)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, params)]
    assert first == alone


def test_preemption_under_speculation_keeps_the_output(models):
    target, draft = models["good"]
    prompts, _ = _workload(6, seed=13)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    llm = _llm(target, draft, 4, kv_cache_tokens=160, max_num_seqs=6)
    engine = llm.engine
    requests = [engine.make_request(str(i), p, params) for i, p in enumerate(prompts)]
    for req in requests:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
        engine.kv_cache.kv_pool.allocator.check_integrity()
    assert sum(req.num_preemptions for req in requests) >= 1
    assert [req.output_token_ids for req in requests] == expected
    _assert_clean(llm)


def test_a_request_that_fills_the_pool_exactly_still_speculates(models):
    """The look-ahead never reaches past prompt + max_tokens, which admission checked."""
    target, draft = models["good"]
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = _llm(target, kv_cache_tokens=64, max_model_len=64).generate(prompt, params)
    llm = _llm(target, draft, 4, kv_cache_tokens=64, max_model_len=64)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == expected[0].token_ids
    assert out.usage.spec_verify_steps < 23
    _assert_clean(llm)
