"""A decode step's draft tree grown on the device (spec/runtime/device_tree.py): the fixed-shape
extend's forks beside each depth's main rows. The trees are the ones the general extender
grows (spec/runtime/tree_extender.py; the two grow by one rule, spec.runtime.tree.TreeGrowth, and
run their forks each their own way), the output stays the target's, and no fork's slots are left
behind."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from devices import DEVICES
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.scheduling.kv_pool import KVPool
from spec.runtime.device_tree import ForkColumns, TreeLayout
from spec.runtime.round_plan import PlanPolicy
from spec.runtime.tree import TreeShape
from spec.runtime.tree_round import keep_accepted_kv

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def all_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """ "fair": a draft noisy enough that the tree's other nodes are often the right ones;
    "random": random weights, whose near-flat proposals show any change in what a fork
    attends or reads."""
    root = tmp_path_factory.mktemp("device_tree")
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "fair", root / "predictable", 3, noise=0.3)
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", 3, seed=1)
    return {
        "fair": (root / "predictable", root / "fair"),
        "random": (root / "target", root / "random"),
    }


@pytest.fixture(scope="module")
def models(all_models) -> tuple[Path, Path]:
    return all_models["fair"]


def _llm(models, device: str, **kw) -> LLM:
    """An engine of `models`' target, speculating with its draft (none: plain decoding)."""
    target, draft = models
    if draft is not None:
        kw = dict(speculative_algorithm=SPEC, draft_model=str(draft), **kw)
        kw.setdefault("num_draft_steps", 3)
    return LLM(str(target), device=device, kv_cache_tokens=8192, max_num_seqs=16, **kw)


def _workload(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(8, 40), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def _record_trees(llm: LLM, monkeypatch, device_tree: bool) -> list:
    """Every tree a decode step's extend proposes, in order, as `llm` runs; with
    `device_tree` False the general extender grows them all, and the host verifies them."""
    worker = llm.engine.speculator
    if not device_tree:
        worker.set_plan_policy(PlanPolicy("always", device_rounds=False, fixed_extend=False))
    trees: list = []
    finish = worker.finish_round

    def recorded_finish(requests, verified, plan):
        finish(requests, verified, plan)
        for req in requests:
            state = req.spec_state
            tree = None if state is None else state.tree
            if tree is not None and not req.finished:
                trees.append((req.request_id, tree.tokens, tree.parents, tree.levels))

    monkeypatch.setattr(worker, "finish_round", recorded_finish)
    return trees


def _counts(llm: LLM) -> dict[str, int]:
    """From the plans `llm`'s decode steps ran: the steps whose extend was the fixed one
    (after a round on the device or the host's verify), and the rounds on the device."""
    plans = llm.engine.plan_counts()
    on_device = sum(n for plan, n in plans.items() if plan.startswith(("tree/d", "tree/q")))
    return {"fixed": on_device + plans.get("tree/host/fixed", 0), "rounds": on_device}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fair", "random"])
@pytest.mark.parametrize("shape", [(None, 3, 8), (None, 4, 14), (3, None, None)])
def test_the_device_grows_the_trees_the_host_does(
    all_models, monkeypatch, device, kind, shape
) -> None:
    """Top-k trees and chains (a tree that branches at depth 0 only), at batch 1 and 7:
    step by step, every request's tree equals the general extender's, and the output equals
    plain decoding's."""
    models = all_models[kind]
    chains, topk, budget = shape
    tree_kw = dict(num_draft_chains=chains, speculative_topk=topk, num_draft_tokens=budget)
    for n in (1, 7):
        prompts, params = _workload(n, n)
        plain = [o.token_ids for o in _llm((models[0], None), device).generate(prompts, params)]
        results = {}
        for on_device in (True, False):
            with monkeypatch.context() as patch:
                llm = _llm(models, device, **tree_kw)
                trees = _record_trees(llm, patch, on_device)
                outputs = [o.token_ids for o in llm.generate(prompts, params)]
                assert outputs == plain
                assert not llm.engine.has_work() and llm.engine.speculator.is_empty()
                results[on_device] = (trees, _counts(llm))
        trees, counts = results[True]
        general_trees, general_counts = results[False]
        assert general_counts == {"fixed": 0, "rounds": 0}
        # Every step after the first of a request's runs on the device where it holds the
        # slots: some rounds do whatever the prompts.
        assert counts["fixed"] > 0 and counts["rounds"] > 0
        assert len(trees) == len(general_trees) > 0
        if device == "cpu":
            assert trees == general_trees
            continue
        # On a GPU the two compute a fork's rows in other kernels: nodes whose scores differ
        # by rounding alone may swap places, or the budget's last node differ.
        same = sum(_paths(mine) == _paths(theirs) for mine, theirs in zip(trees, general_trees))
        assert same >= 0.9 * len(trees), (same, len(trees))


def _paths(recorded) -> set[tuple[int, ...]]:
    """A recorded tree as the set of its nodes' paths from the root: what it verifies."""
    _, tokens, parents, _ = recorded
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def test_requests_near_max_tokens_take_the_hosts_round(models, monkeypatch) -> None:
    """Answers shorter than a tree: a request whose own slots end before its tree's last
    nodes is verified on the host, which takes slots for them; the output is plain
    decoding's, and every slot is given back, the depths' past the target's included."""
    prompts, params = _workload(3, 6)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in range(3, 9)]
    plain = [o.token_ids for o in _llm((models[0], None), "cpu").generate(prompts, params)]
    llm = _llm(models, "cpu", speculative_topk=4, num_draft_tokens=12)
    _record_trees(llm, monkeypatch, True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    counts = _counts(llm)
    assert counts["rounds"] == 0 and counts["fixed"] > 0
    assert llm.engine.kv_cache.is_empty() and llm.engine.speculator.is_empty()


def test_trees_too_wide_for_the_masks_take_the_general_extend(all_models, tmp_path) -> None:
    """A top-8 tree over 8 depths would give the deepest depth 16 main rows and 7 forks of 7
    rows, past the 63 bits of a visibility mask: the general extend grows it, and the output
    is plain decoding's."""
    target, _ = all_models["random"]
    make_random_draft(tmp_path / "deep", target, 8, seed=2)
    assert not TreeLayout(TreeShape.top_k(8, 30), 8).fits_masks
    prompts, params = _workload(4, 2)
    plain = [o.token_ids for o in _llm((target, None), "cpu").generate(prompts, params)]
    llm = _llm(
        (target, tmp_path / "deep"), "cpu", num_draft_steps=8, speculative_topk=8,
        num_draft_tokens=30,
    )  # fmt: skip
    assert llm.engine.speculator.fixed_extend.declines_all
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain


def test_the_layout_of_a_top_k_tree_and_of_chains() -> None:
    top4 = TreeLayout(TreeShape.top_k(4, 12), 3)
    assert top4.forks == [0, 3, 3]
    assert top4.level_sizes == [4, 16, 16]
    assert top4.span_widths == [4, 5 + 3, 6 + 6]
    assert top4.budget == 12
    chains = TreeLayout(TreeShape.chains(3, 3), 3)
    assert chains.forks == [0, 2, 2] and chains.level_sizes == [3, 3, 3]
    assert chains.budget == 9 == chains.num_candidates
    # A fork row's own bits: itself and its fork's rows before it, after the main rows.
    bits = ForkColumns(top4, torch.device("cpu")).own_bits[2].tolist()
    assert bits == [1 << 6, 3 << 6, 1 << 8, 3 << 8, 1 << 10, 3 << 10]


def test_the_accepted_nodes_kv_moves_to_the_positions_kept() -> None:
    """Each request's accepted nodes wrote KV at m + their span row; afterwards positions
    m+1 .. m+a hold it, every other slot is unchanged (but the padding slot)."""
    pool = KVPool(64, 2, 1, 4, torch.float32, "cpu")
    pool.kv_buffer.copy_(torch.arange(pool.kv_buffer.numel()).view_as(pool.kv_buffer))
    before = pool.kv_buffer.clone()
    table = torch.zeros((3, 32), dtype=torch.int64)
    table[0] = torch.arange(1, 33)
    table[1] = torch.arange(33, 65)
    rows, newest = torch.tensor([0, 1]), torch.tensor([5, 2])
    path = torch.tensor([[0, 3, 5, 9], [0, 1, 2, 0]])  # request 1 keeps its leading nodes
    accepted = torch.tensor([3, 2])
    keep_accepted_kv(pool, table, rows, newest, path, accepted)
    after = pool.kv_buffer
    for j, row in enumerate([3, 5, 9], start=1):
        assert torch.equal(after[table[0, 5 + j]], before[table[0, 5 + row]])
    changed = (after != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {0} | {int(table[0, 5 + j]) for j in (1, 2, 3)}
