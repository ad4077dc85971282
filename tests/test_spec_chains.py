"""Alternative draft chains (`num_draft_chains`): greedy requests draft chains that start with
depth 0's next most likely tokens, each step verifies them beside the main chain and keeps the
one accepted furthest. Output stays the target's own, every fork's rows and slots are returned,
and each chain is what the draft proposes after its first token."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from cluster.cli import build_parser, main
from cluster.cli_commands import engine_args
from engine import LLM, SamplingParams
from engine.errors import PdclusterError
from engine.loader import DEFAULT_DRAFT_CHAINS, EngineArgs, resolve
from spec.draft_vocab import DraftHead
from spec.train.dense import draft_forward, target_forward

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """draft kind -> (target folder, draft folder). "fair": a good draft made noisy enough that
    its first guess is often wrong while its second or third is right."""
    root = tmp_path_factory.mktemp("spec_chains")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", 3, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "fair", root / "predictable", 3, noise=0.3)
    return {
        "random": (root / "target", root / "random"),
        "fair": (root / "predictable", root / "fair"),
    }


def _llm(target: Path, draft: Path | None = None, chains: int | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("max_num_seqs", 16)
    if draft is not None:
        kw.update(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_chains=chains)
    return LLM(str(target), device="cpu", **kw)


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 30), temperature=0, ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


def _assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty()
    assert llm.engine.speculator.is_empty()


def _accepted(outputs) -> int:
    return sum(o.usage.completion_tokens_details.accepted_prediction_tokens for o in outputs)


@pytest.mark.parametrize("batch_size", [1, 6])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("chains", [2, 4])
@pytest.mark.parametrize("kind", ["random", "fair"])
def test_greedy_output_with_alternative_chains_equals_the_target_alone(
    models, kind: str, chains: int, k: int, batch_size: int
) -> None:
    target, draft = models[kind]
    prompts, params = _workload(batch_size, seed=batch_size + k)
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    llm = _llm(target, draft, chains, num_draft_steps=k)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    _assert_clean(llm)


def test_alternative_chains_raise_the_accept_length(models) -> None:
    """With the noisy draft, some steps accept an alternative: their drafts' KV moves to the
    request's own slots, and the output above stays the target's only if it moved right."""
    target, draft = models["fair"]
    prompts, params = _workload(12, seed=3)
    one = _llm(target, draft, 1).generate(prompts, params)
    four = _llm(target, draft, 4).generate(prompts, params)
    assert [o.token_ids for o in four] == [o.token_ids for o in one]
    assert _accepted(four) > _accepted(one) * 1.1


def test_every_chain_is_what_the_draft_proposes_after_its_first_token(models) -> None:
    """After every step, the main chain and each alternative equal the trainer's dense draft
    forward over the committed tokens followed by that chain: depth d at the newest position
    reads the chain's token d-1. The alternatives start with depth 0's 2nd, 3rd, ... choice."""
    target, draft = models["random"]
    llm = _llm(target, draft, 3)
    engine, worker = llm.engine, llm.engine.speculator
    runner = engine.runner
    head = DraftHead(runner.model, None)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests = [
        engine.make_request(str(i), p, params)
        for i, p in enumerate([[5, 9, 200, 31], [7], list(range(3, 40))])
    ]
    for req in requests:
        engine.add_request(req)
    checked = 0
    while engine.has_work():
        engine.step()
        for req in requests:
            state = req.spec_state
            if req.finished or state is None or not req.lookahead:
                continue
            assert len(state.alt_chains) == 2
            committed = req.all_token_ids
            m = len(committed) - 1  # depth d at position m-1 reads token m+d
            tokens = torch.tensor(committed)
            with torch.no_grad():
                hidden, _ = target_forward(runner.model, runner.rotary, tokens[None])
                top, _ = head.propose_top(_dense(worker, runner, tokens, hidden)[0][m - 1 : m], 3)
            assert [state.chain[0], *(alt[0] for alt in state.alt_chains)] == top[0].tolist()
            for chain in [state.chain, *state.alt_chains]:
                tokens = torch.tensor(committed + chain[:-1])
                with torch.no_grad():
                    hidden, _ = target_forward(runner.model, runner.rotary, tokens[None])
                    outputs = _dense(worker, runner, tokens, hidden)
                proposed = [int(head.argmax(out[m - 1])) for out in outputs]
                assert proposed[1:] == chain[1:]
                checked += 1
    assert checked > 20
    _assert_clean(llm)


def _dense(worker, runner, tokens: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    class Draft:
        depths = [depth.module for depth in worker.depths]

    return draft_forward(Draft, runner.model, runner.rotary, tokens[None], hidden)


def test_sampled_requests_verify_their_main_chain_only(models) -> None:
    target, draft = models["fair"]
    prompts, _ = _workload(4, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    one = _llm(target, draft, 1).generate(prompts, params)
    three = _llm(target, draft, 3).generate(prompts, params)
    assert [o.token_ids for o in three] == [o.token_ids for o in one]
    assert [o.usage.completion_tokens_details for o in three] == [
        o.usage.completion_tokens_details for o in one
    ]


def test_every_verified_alternative_draft_counts_as_proposed(models) -> None:
    """The random draft is never right on this prompt, so both engines take the same steps:
    three chains verify three times the draft tokens, all of them rejected."""
    target, draft = models["random"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    (one,) = _llm(target, draft, 1).generate([[10, 20, 30]], params)
    (three,) = _llm(target, draft, 3).generate([[10, 20, 30]], params)
    details_one = one.usage.completion_tokens_details
    details_three = three.usage.completion_tokens_details
    assert details_one.accepted_prediction_tokens == details_three.accepted_prediction_tokens == 0
    assert one.usage.spec_verify_steps == three.usage.spec_verify_steps
    assert details_three.rejected_prediction_tokens == 3 * details_one.rejected_prediction_tokens


def test_alternatives_give_way_when_the_pool_is_short(models) -> None:
    """A pool with room for the requests but hardly any more: steps verify what fits (the main
    chains at least) and the output is unchanged."""
    target, draft = models["fair"]
    prompts = [[3 + i] * 10 for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    llm = _llm(target, draft, 4, kv_cache_tokens=3 * (10 + 24) + 2)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    _assert_clean(llm)


def test_the_request_table_has_a_row_per_chain(models) -> None:
    target, draft = models["random"]
    llm = _llm(target, draft, 3, max_num_seqs=5)
    assert llm.engine.runner.req_to_token_pool.max_reqs == 15
    assert all(d.req_to_token_pool.max_reqs == 15 for d in llm.engine.speculator.depths)


def test_chains_default_to_one_on_every_device(models) -> None:
    target, draft = models["random"]
    args = EngineArgs(
        model=str(target), kv_cache_tokens=256, speculative_algorithm=SPEC, draft_model=str(draft)
    )
    assert resolve(dataclasses.replace(args, device="cpu")).engine_config.num_draft_chains == 1
    # Resolving touches no device, so a GPU engine's settings can be checked without one.
    gpu = resolve(dataclasses.replace(args, device="cuda", dtype="bfloat16")).engine_config
    assert gpu.num_draft_chains == DEFAULT_DRAFT_CHAINS == 1
    assert gpu.num_request_rows == gpu.max_num_seqs
    plain = EngineArgs(model=str(target), kv_cache_tokens=256, device="cuda", dtype="bfloat16")
    assert resolve(plain).engine_config.num_draft_chains == 1
    explicit = dataclasses.replace(args, device="cuda", dtype="bfloat16", num_draft_chains=2)
    assert resolve(explicit).engine_config.num_draft_chains == 2


def test_bad_chain_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_draft_chains must be >= 1"):
        EngineArgs(speculative_algorithm=SPEC, num_draft_chains=0)
    with pytest.raises(ValueError, match="needs a speculative_algorithm"):
        EngineArgs(num_draft_chains=2)


def test_the_chains_flag_reaches_the_engine_and_bad_values_are_a_message(capsys) -> None:
    args = build_parser().parse_args(
        ["serve", "--speculative-algorithm", SPEC, "--num-draft-chains", "3"]
    )
    assert engine_args(args).num_draft_chains == 3
    assert main(["generate", "--speculative-algorithm", SPEC, "--num-draft-chains", "0", "hi"]) == 2
    assert "num_draft_chains must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["verify", "draft depth 2"])
def test_a_failed_forward_gives_back_every_fork_and_alternative(models, where: str) -> None:
    target, draft = models["random"]
    llm = _llm(target, draft, 3)
    worker = llm.engine.speculator
    calls = {"n": 0}

    def fail_later(original):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 2:  # after the prefill's extend and a step: forks exist by then
                raise RuntimeError("injected")
            return original(*args, **kwargs)

        return wrapped

    if where == "verify":
        runner = worker.runner
        runner.forward_every_token = fail_later(runner.forward_every_token)
    else:
        worker.depths[2].forward_flat = fail_later(worker.depths[2].forward_flat)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with pytest.raises(PdclusterError, match="injected"):
        llm.generate([[5, 9, 200, 31], list(range(3, 30))], params)
    _assert_clean(llm)


def test_requests_hold_at_most_max_num_seqs_rows(models) -> None:
    """The table has a row per chain and request; a decode node admits by free rows, and the
    cap keeps the alternatives' rows for them."""
    target, draft = models["random"]
    cache = _llm(target, draft, 3, max_num_seqs=2).engine.kv_cache
    assert cache.req_to_token_pool.max_reqs == 6 and cache.max_requests == 2
    holders = [SimpleNamespace(row=None, slots=[]) for _ in range(2)]
    for holder in holders:
        assert cache.can_grow(4, 1)
        cache.grow(holder, 4)
    assert not cache.can_grow(4, 1) and cache.can_grow(4)
    for holder in holders:
        cache.release(holder)
