"""The decode step's fixed-shape draft extend (spec/runtime/decode_extend.py) is the general draft
extend of spec/runtime/draft_extend.py padded: same chains, same boundary states, same acceptance,
whatever the draft depth count, batch and prompt lengths, for chains and trees alike; it leaves
nothing behind, and it steps aside where it cannot run (short prompts, tensor dumps)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool, grow_holders
from spec.runtime.draft_runner import DraftSeq
from spec.runtime.extend_items import GatheredItems, grow_depths
from spec.runtime.round_plan import PlanPolicy

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fixed_extend")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", 4, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "good", root / "predictable", 4, noise=0.05)
    return {
        "random": (root / "target", root / "random"),
        "good": (root / "predictable", root / "good"),
    }


def _llm(models, kind: str, k: int, **kw) -> LLM:
    target, draft = models[kind]
    kw.setdefault("kv_cache_tokens", 8192)
    kw.setdefault("max_num_seqs", 16)
    return LLM(
        str(target), device="cpu", speculative_algorithm=SPEC,
        draft_model=str(draft), num_draft_steps=k, **kw,
    )  # fmt: skip


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1 to 50 tokens (some shorter than the draft depths, which start on the
    general path) and answers of 1 to 40 tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 50))] for _ in range(12)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def _run(llm: LLM, prompts, params, fixed: bool) -> tuple[list, int]:
    """The outputs of `llm`, and how many decode steps ran the fixed extend: in a round on
    the device, or after the host's verify. Without `fixed`, every round is the host's with
    the general extend."""
    worker = llm.engine.speculator
    if not fixed:
        worker.set_plan_policy(PlanPolicy("always", device_rounds=False, fixed_extend=False))
    outputs = llm.generate(prompts, params)
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty() and worker.is_empty()
    summary = [
        (o.token_ids, o.usage.spec_verify_steps, o.usage.spec_accepted_per_position)
        for o in outputs
    ]
    plans = llm.engine.plan_counts()
    runs = sum(
        n for plan, n in plans.items() if not plan.startswith("plain") and "/general" not in plan
    )
    if not fixed:
        assert runs == 0 and plans, plans
    return summary, runs


@pytest.mark.parametrize("kind", ["good", "random"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_fixed_extend_drafts_exactly_what_the_general_one_does(models, kind: str, k: int):
    prompts, params = _workload(seed=k)
    fixed, runs = _run(_llm(models, kind, k), prompts, params, fixed=True)
    general, _ = _run(_llm(models, kind, k), prompts, params, fixed=False)
    assert runs > 0
    # Tokens, verify steps and the drafts accepted at each position: the same chains were
    # proposed at every step.
    assert fixed == general
    if kind == "good":
        assert sum(sum(per_position) for _, _, per_position in fixed) > 0


def test_a_batch_mixes_requests_at_every_stage(models):
    """Requests join while others decode, and some finish mid-batch: each step's extend takes
    the fixed path when every request in it can, the general path otherwise."""
    llm = _llm(models, "good", 3, max_num_seqs=4)
    prompts, params = _workload(seed=11)
    fixed, runs = _run(llm, prompts, params, fixed=True)
    general, _ = _run(_llm(models, "good", 3, max_num_seqs=4), prompts, params, fixed=False)
    assert runs > 0 and fixed == general


@pytest.mark.parametrize("tree", [{"num_draft_chains": 3}, {"speculative_topk": 3}])
def test_alternative_chains_and_trees_take_it_too(models, tree):
    """Their other nodes are forks beside its main rows (spec/runtime/device_tree.py): the same
    verify steps and accepted drafts as the general path's."""
    prompts, params = _workload(seed=5)
    fixed, runs = _run(_llm(models, "good", 3, **tree), prompts, params, fixed=True)
    general, _ = _run(_llm(models, "good", 3, **tree), prompts, params, fixed=False)
    assert runs > 0 and fixed == general


def test_tensor_dumps_take_the_general_path(models, tmp_path):
    llm = _llm(models, "good", 2, debug_tensor_dump_dir=tmp_path / "dump")
    _, runs = _run(llm, [[5, 6, 7, 8, 9, 10]], [SamplingParams(max_tokens=6, temperature=0)], True)
    assert runs == 0


class _Depth:
    """A draft depth's pools and its growth, as `grow_depths` uses them."""

    def __init__(self) -> None:
        self.kv_pool = KVPool(300, 1, 1, 2, torch.float32, "cpu")
        self.req_to_token_pool = ReqToTokenPool(4, 64, "cpu")

    def grow_many(self, targets: list[tuple[DraftSeq, int]]) -> None:
        grants = [(seq, max(0, n - len(seq.slots))) for seq, n in targets]
        grow_holders(self.kv_pool, self.req_to_token_pool, grants)


def test_a_batchs_draft_slots_grow_together_when_one_sequence_must_grow() -> None:
    """Each depth holds its slots up to position m+K of every request. When some sequence is
    short of that, every sequence holding fewer positions than its request may hold takes them
    all at once (the batch's depths then grow every few rounds, not one request a round); when
    none is short, nothing grows."""
    k, depths = 3, [_Depth(), _Depth()]
    held = [[24, 30, 23], [24, 30, 24]]  # per depth, per request; m + K + 1 = 24
    seqs = [[DraftSeq() for _ in range(3)] for _ in depths]
    for depth, row_seqs, counts in zip(depths, seqs, held):
        depth.grow_many(list(zip(row_seqs, counts)))
    newest, may_hold = [20, 20, 20], [40, 24, 30]  # each request's m, and the slots it holds

    def gathered(depth_seqs: list[list[DraftSeq]]) -> GatheredItems:
        return GatheredItems.from_lists(newest, may_hold, [list(s) for s in zip(*depth_seqs)])

    grow_depths(depths[1:], gathered(seqs[1:]), k)
    assert [len(seq.slots) for seq in seqs[1]] == [24, 30, 24]  # none short: none grew
    items = gathered(seqs)
    grow_depths(depths, items, k)
    assert [len(seq.slots) for seq in seqs[0]] == [40, 30, 30]  # the short one, and the rest
    assert [len(seq.slots) for seq in seqs[1]] == [40, 30, 30]
    assert items.held.tolist() == [[40, 30, 30], [40, 30, 30]]
    for depth, depth_seqs in zip(depths, seqs):
        for seq in depth_seqs:
            table = depth.req_to_token_pool.req_to_token
            assert table[seq.row, : len(seq.slots)].tolist() == seq.slots
        depth.kv_pool.allocator.check_integrity()
