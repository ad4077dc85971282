"""Draft token trees (spec/runtime/tree.py): `speculative_topk` trees and `num_draft_chains` chains,
which are trees that branch at the first draft only. Each step verifies a request's tree in one
forward and keeps the longest path the target agrees with. Output stays the target's own, every
fork's rows and every node's slots are returned, and each node is what the draft proposes
after its path."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from cluster.commands.cli import build_parser, main
from cluster.commands.cli_commands import engine_args
from engine import LLM, SamplingParams
from engine.errors import PdclusterError
from engine.loading.loader import DEFAULT_DRAFT_CHAINS, EngineArgs, resolve
from engine.request import Request
from spec.draft_vocab import DraftHead
from spec.runtime.tree_verify import TreeSlots
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


def _tree_llm(target: Path, draft: Path, topk: int, budget: int | None = None, **kw) -> LLM:
    return _llm(target, draft, speculative_topk=topk, num_draft_tokens=budget, **kw)


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


# (chains, topk, num_draft_tokens)
SHAPES = {
    "2 chains": (2, None, None),
    "3 chains": (3, None, None),
    "4 chains": (4, None, None),
    "top-2 tree": (None, 2, None),
    "top-4 tree of 10": (None, 4, 10),
    "top-3 tree of 3": (None, 3, 3),
}


def _shaped_llm(target: Path, draft: Path, shape: str, **kw) -> LLM:
    chains, topk, budget = SHAPES[shape]
    return _llm(target, draft, chains, speculative_topk=topk, num_draft_tokens=budget, **kw)


@pytest.mark.parametrize("batch_size", [1, 6])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "shape", ["2 chains", "4 chains", "top-2 tree", "top-4 tree of 10", "top-3 tree of 3"]
)
@pytest.mark.parametrize("kind", ["random", "fair"])
def test_greedy_output_with_a_draft_tree_equals_the_target_alone(
    models, kind: str, shape: str, k: int, batch_size: int
) -> None:
    target, draft = models[kind]
    prompts, params = _workload(batch_size, seed=batch_size + k)
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    llm = _shaped_llm(target, draft, shape, num_draft_steps=k)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    _assert_clean(llm)


@pytest.mark.parametrize("shape", ["4 chains", "top-4 tree of 10"])
def test_trees_raise_the_accept_length(models, shape: str) -> None:
    """With the noisy draft, many steps accept a node off the greedy chain: its KV goes to the
    request's own positions, and the output above stays the target's only if it went right."""
    target, draft = models["fair"]
    prompts, params = _workload(12, seed=3)
    one = _llm(target, draft, 1).generate(prompts, params)
    tree = _shaped_llm(target, draft, shape).generate(prompts, params)
    assert [o.token_ids for o in tree] == [o.token_ids for o in one]
    assert _accepted(tree) > _accepted(one) * 1.1


def test_every_node_is_what_the_draft_proposes_after_its_path(models) -> None:
    """After every step, each tree node's children are among the likeliest tokens of the
    trainer's dense draft forward over the committed tokens followed by the node's path: depth
    l at the newest position reads the path's token l. The greedy chain is the tree's path of
    first choices, and a tree holds its budget of nodes, parents first."""
    target, draft = models["random"]
    topk, budget = 3, 8
    llm = _tree_llm(target, draft, topk, budget)
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
            tree = state.tree
            assert tree is not None and len(tree) == budget
            assert all(parent < i for i, parent in enumerate(tree.parents))
            committed = req.all_token_ids
            m = len(committed) - 1  # depth l at position m-1 reads token m+l
            for row, kids in enumerate(tree.children()):
                if not kids:
                    continue
                path = tree.path(row - 1) if row else []
                tokens = torch.tensor(committed + path)
                with torch.no_grad():
                    hidden, _ = target_forward(runner.model, runner.rotary, tokens[None])
                    outputs = _dense(worker, runner, tokens, hidden)
                    top, _ = head.propose_top(outputs[len(path)][m - 1 : m], topk)
                assert {tree.tokens[n] for n in kids} <= set(top[0].tolist())
                checked += 1
            assert tree.path(tree.children()[0][0]) == state.chain[:1]
    assert checked > 20
    _assert_clean(llm)


def _dense(worker, runner, tokens: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    class Draft:
        depths = [depth.module for depth in worker.depths]

    return draft_forward(Draft, runner.model, runner.rotary, tokens[None], hidden)


@pytest.mark.parametrize("shape", ["3 chains", "top-4 tree of 10"])
def test_seeded_sampled_trees_commit_what_plain_decoding_draws(models, shape: str) -> None:
    """Each committed token of a sampled request is the target's own draw at its position,
    from the generator plain decoding would use there: seeded output is plain decoding's,
    whatever the tree, the batch, or the room the pool left for the trees."""
    target, draft = models["fair"]
    prompts = [[3 + i] * 10 for i in range(3)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=11 + i, ignore_eos=True)
        for i in range(3)
    ]
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    short = _shaped_llm(target, draft, shape, kv_cache_tokens=3 * (10 + 24) + 2)
    outputs = short.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert _accepted(outputs) > 0
    alone = _shaped_llm(target, draft, shape)
    assert [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params)] == expected


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


@pytest.mark.parametrize("shape", ["4 chains", "top-4 tree of 10"])
def test_trees_give_way_when_the_pool_is_short(models, shape: str) -> None:
    """A pool with room for the requests but hardly any more: steps verify what fits (as many
    nodes as the requests' own slots hold at least) and the output is unchanged."""
    target, draft = models["fair"]
    prompts = [[3 + i] * 10 for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    llm = _shaped_llm(target, draft, shape, kv_cache_tokens=3 * (10 + 24) + 2)
    cuts = []
    span_slots = TreeSlots.span_slots

    def counted(self, req, num_nodes):
        slots = span_slots(self, req, num_nodes)
        cuts.append(len(slots) < 1 + num_nodes)
        return slots

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TreeSlots, "span_slots", counted)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert any(cuts) and not all(cuts)  # some trees were cut to the room left, some not
    _assert_clean(llm)


def test_the_request_table_has_a_row_per_expanded_node(models) -> None:
    target, draft = models["random"]
    llm = _llm(target, draft, 3, max_num_seqs=5)
    assert llm.engine.runner.req_to_token_pool.max_reqs == 5  # the target's rows: requests
    assert all(d.req_to_token_pool.max_reqs == 15 for d in llm.engine.speculator.depths)
    tree = _tree_llm(target, draft, 4, max_num_seqs=5)
    assert tree.engine.runner.req_to_token_pool.max_reqs == 5
    assert all(d.req_to_token_pool.max_reqs == 20 for d in tree.engine.speculator.depths)


def test_chains_default_to_one_on_every_device(models) -> None:
    target, draft = models["random"]
    args = EngineArgs(
        model=str(target), kv_cache_tokens=256, speculative_algorithm=SPEC, draft_model=str(draft)
    )
    assert resolve(dataclasses.replace(args, device="cpu")).engine_config.num_draft_chains == 1
    # Resolving touches no device, so a GPU engine's settings can be checked without one.
    gpu = resolve(dataclasses.replace(args, device="cuda", dtype="bfloat16")).engine_config
    assert gpu.num_draft_chains == DEFAULT_DRAFT_CHAINS == 1
    assert gpu.draft_request_rows == gpu.max_num_seqs
    plain = EngineArgs(model=str(target), kv_cache_tokens=256, device="cuda", dtype="bfloat16")
    assert resolve(plain).engine_config.num_draft_chains == 1
    explicit = dataclasses.replace(args, device="cuda", dtype="bfloat16", num_draft_chains=2)
    assert resolve(explicit).engine_config.num_draft_chains == 2
    tree = resolve(dataclasses.replace(args, device="cpu", speculative_topk=4)).engine_config
    assert (tree.speculative_topk, tree.num_draft_tokens) == (4, 0)  # 0: topk x depths


def test_bad_tree_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_draft_chains must be >= 1"):
        EngineArgs(speculative_algorithm=SPEC, num_draft_chains=0)
    with pytest.raises(ValueError, match="needs a speculative_algorithm"):
        EngineArgs(num_draft_chains=2)
    with pytest.raises(ValueError, match="need a speculative_algorithm"):
        EngineArgs(speculative_topk=2)
    with pytest.raises(ValueError, match="speculative_topk must be >= 1"):
        EngineArgs(speculative_algorithm=SPEC, speculative_topk=0)
    with pytest.raises(ValueError, match="needs speculative_topk >= 2"):
        EngineArgs(speculative_algorithm=SPEC, num_draft_tokens=8)
    with pytest.raises(ValueError, match="num_draft_tokens must be in 1..62"):
        EngineArgs(speculative_algorithm=SPEC, speculative_topk=4, num_draft_tokens=63)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(speculative_algorithm=SPEC, speculative_topk=4, num_draft_chains=2)


def test_the_tree_flags_reach_the_engine_and_bad_values_are_a_message(capsys) -> None:
    args = build_parser().parse_args(
        ["serve", "--speculative-algorithm", SPEC, "--num-draft-chains", "3"]
    )
    assert engine_args(args).num_draft_chains == 3
    flags = ["--speculative-algorithm", SPEC, "--speculative-topk", "4", "--num-draft-tokens", "9"]
    args = engine_args(build_parser().parse_args(["serve", *flags]))
    assert (args.speculative_topk, args.num_draft_tokens) == (4, 9)
    assert main(["generate", "--speculative-algorithm", SPEC, "--num-draft-chains", "0", "hi"]) == 2
    assert "num_draft_chains must be >= 1" in capsys.readouterr().err
    bad = ["--speculative-algorithm", SPEC, "--speculative-topk", "2", "--num-draft-tokens", "99"]
    assert main(["generate", *bad, "hi"]) == 2
    assert "num_draft_tokens must be in 1..62" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["4 chains", "top-4 tree of 10"])
@pytest.mark.parametrize("where", ["verify", "draft depth 2"])
def test_a_failed_forward_gives_back_every_fork_and_node(models, where: str, shape: str) -> None:
    target, draft = models["random"]
    llm = _shaped_llm(target, draft, shape)
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
        # Every draft forward, the prefill's extend and the decode steps' alike, runs here.
        worker.depths[2].forward_tokens = fail_later(worker.depths[2].forward_tokens)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with pytest.raises(PdclusterError, match="injected"):
        llm.generate([[5, 9, 200, 31], list(range(3, 30))], params)
    _assert_clean(llm)


def test_requests_hold_at_most_max_num_seqs_rows(models) -> None:
    """The target's table has a row per request (the draft depths' have the forks'); a decode
    node admits by free rows, at most max_num_seqs."""
    target, draft = models["random"]
    cache = _llm(target, draft, 3, max_num_seqs=2).engine.kv_cache
    assert cache.req_to_token_pool.max_reqs == 2 and cache.max_requests == 2
    holders = [Request(str(i), [1, 2, 3, 4], SamplingParams(max_tokens=1)) for i in range(2)]
    for holder in holders:
        assert cache.can_grow(4, 1)
        cache.grow(holder, 4)
    assert not cache.can_grow(4, 1) and cache.can_grow(4)
    for holder in holders:
        cache.release(holder)


def _held_slots(engine) -> tuple[int, list[int]]:
    """Slots the live requests and the prefix cache hold in the target's pool and in each
    depth's (a request reads its cached prefix from the cache's slots)."""
    running = [req for req in engine.scheduler.running]
    target = len(set(engine.kv_cache.cached_slots()).union(*(req.slots for req in running)))
    cache = engine.speculator.prefix_drafts
    depths = [
        len(
            set(cache.cached_slots(d)).union(
                *(req.spec_state.seqs[d].slots for req in running if req.spec_state is not None)
            )
        )
        for d in range(len(engine.speculator.depths))
    ]
    return target, depths


def test_rejected_nodes_leave_no_kv_behind(models) -> None:
    """After every round the pools hold what the requests hold and nothing more: the nodes
    off the accepted path gave their slots back, the forks their rows, also when a request is
    aborted between rounds."""
    target, draft = models["fair"]
    llm = _tree_llm(target, draft, 4, 12)
    engine, worker = llm.engine, llm.engine.speculator
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts, _ = _workload(5, seed=8)
    requests = [engine.make_request(str(i), p, params) for i, p in enumerate(prompts)]
    for req in requests:
        engine.add_request(req)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort(requests[1].request_id)
        held, held_by_depth = _held_slots(engine)
        assert engine.runner.kv_pool.allocator.num_used == held
        for runner, count in zip(worker.depths, held_by_depth):
            assert runner.kv_pool.allocator.num_used == count
            free_rows = runner.req_to_token_pool.num_free_rows
            live = sum(
                1
                for r in engine.scheduler.running
                if r.spec_state and r.spec_state.seqs[runner.depth].row is not None
            )
            assert free_rows == runner.req_to_token_pool.max_reqs - live
    assert _accepted_stats(requests) > 0
    _assert_clean(llm)


def _accepted_stats(requests) -> int:
    return sum(req.spec_stats.accepted_tokens for req in requests if req.spec_stats)


@pytest.mark.parametrize("settings", [{"num_draft_chains": 22}, {"speculative_topk": 21}])
def test_trees_past_the_mask_width_are_refused_or_capped(models, settings) -> None:
    """A verify span carries each token's mask in 64 bits: 22 chains of 3 drafts are refused
    when the engine starts, a top-21 tree's default budget (63) is capped at 62."""
    target, draft = models["random"]
    if "num_draft_chains" in settings:
        with pytest.raises(ValueError, match="at most 62 are verified at once"):
            _llm(target, draft, settings["num_draft_chains"])
        return
    llm = _llm(target, draft, **settings)
    assert llm.engine.speculator.shape.budget == 62
    prompts, params = _workload(2, seed=4)
    expected = [o.token_ids for o in _llm(target).generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
