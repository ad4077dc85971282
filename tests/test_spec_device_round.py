"""A speculative round decided on the device (spec/runtime/device_round.py): verify, acceptance and
the fixed draft extend queued back to back and read once. It must commit what the host's round
commits, with the same statistics, and leave nothing behind; requests whose round needs the host
(sampling, penalties, logprobs) make their steps take the host's round."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.request import Request
from engine.scheduling.allocator import PADDING_SLOT
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool, grow_holders
from spec.runtime.device_round import GROW_AHEAD, grow_for_next_round
from spec.runtime.extend_items import GatheredItems
from spec.runtime.round_plan import PlanPolicy

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("device_round")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", 3, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "good", root / "predictable", 3, noise=0.05)
    return {
        "random": (root / "target", root / "random"),
        "good": (root / "predictable", root / "good"),
    }


def _llm(models, kind: str, k: int) -> LLM:
    target, draft = models[kind]
    return LLM(
        str(target), device="cpu", speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=k, kv_cache_tokens=8192, max_num_seqs=16,
    )  # fmt: skip


def _workload(seed: int, extra: list[SamplingParams] = ()) -> tuple[list, list]:
    """Greedy prompts of 4 to 40 tokens; answers that stop at EOS, a stop token or max_tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 40))] for _ in range(10)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(5, 40),
            temperature=0,
            ignore_eos=i % 3 != 0,
            stop_token_ids=[rng.randrange(3, 300)] if i % 3 == 1 else [],
        )
        for i in range(len(prompts))
    ]
    params[: len(extra)] = extra
    return prompts, params


def _run(llm: LLM, prompts, params, on_device: bool) -> tuple[list, int]:
    """`llm`'s outputs and statistics, and how many of its rounds were decided on the device;
    without `on_device`, every round is the host's."""
    worker = llm.engine.speculator
    if not on_device:
        worker.set_plan_policy(PlanPolicy("always", device_rounds=False))
    outputs = llm.generate(prompts, params)
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty() and worker.is_empty()
    summary = [
        (
            o.token_ids,
            o.finish_reason,
            o.usage.spec_verify_steps,
            o.usage.spec_accepted_per_position,
        )
        for o in outputs
    ]
    plans = llm.engine.plan_counts()
    if not on_device:
        assert _on_device(plans) == 0
    return summary, _on_device(plans)


def _on_device(plans: dict[str, int]) -> int:
    """Rounds decided on the device, of the plans an engine counted."""
    return sum(n for plan, n in plans.items() if plan.startswith(("chain/d", "chain/q")))


@pytest.mark.parametrize("kind", ["good", "random"])
@pytest.mark.parametrize("k", [1, 3])
def test_the_device_round_commits_what_the_host_round_does(models, kind, k):
    prompts, params = _workload(seed=k)
    device, rounds = _run(_llm(models, kind, k), prompts, params, True)
    host, _ = _run(_llm(models, kind, k), prompts, params, False)
    assert rounds > 5
    assert device == host
    if kind == "good":
        assert sum(sum(per_position) for *_, per_position in device) > 0


def test_requests_that_need_the_host_take_the_host_round(models):
    """A sampled request, a penalized one and one with logprobs in the batch: while they run,
    rounds are the host's; output is unchanged, and rounds go to the device once they left."""
    extra = [
        SamplingParams(max_tokens=4, temperature=0.8, seed=3),
        SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.2),
        SamplingParams(max_tokens=6, temperature=0, logprobs=1),
    ]
    prompts, params = _workload(seed=7, extra=extra)
    device, rounds = _run(_llm(models, "good", 3), prompts, params, True)
    host, _ = _run(_llm(models, "good", 3), prompts, params, False)
    assert device == host
    steps = max(steps for _, _, steps, _ in device)
    assert 0 < rounds < steps


def test_the_next_rounds_slots_are_taken_while_the_device_verifies() -> None:
    """Slots for the next verify whatever this round accepts (k + 1 tokens, then the newest and
    k drafts: num_tokens + 2k + 1) and GROW_AHEAD more when they must grow, never past prompt +
    max_tokens, and only where the pool keeps a step's room for every request after them; a
    request that holds enough is left alone."""

    def setup(capacity: int) -> tuple[KVPool, ReqToTokenPool, list[Request]]:
        pool, table = KVPool(capacity, 1, 1, 2, torch.float32, "cpu"), ReqToTokenPool(4, 64, "cpu")
        short = Request("short", [1] * 5, SamplingParams(max_tokens=6))  # bound 11
        long = Request("long", [1] * 5, SamplingParams(max_tokens=50))
        for req in (short, long):
            req.output_token_ids = [2, 2]  # num_tokens 7
            grow_holders(pool, table, [(req, req.num_tokens + 3)])  # this round's verify
        return pool, table, [short, long]

    pool, table, (short, long) = setup(capacity=100)
    grow_for_next_round([short, long], 3, pool, table)
    assert len(short.slots) == 11 and len(long.slots) == 7 + 2 * 3 + 1 + GROW_AHEAD
    assert table.req_to_token[long.row, : len(long.slots)].tolist() == long.slots
    pool.allocator.check_integrity()
    long.output_token_ids += [2] * GROW_AHEAD  # num_tokens + 2k + 1 is what it holds now
    free = pool.allocator.num_free
    grow_for_next_round([short, long], 3, pool, table)
    assert pool.allocator.num_free == free
    long.output_token_ids.append(2)
    grow_for_next_round([short, long], 3, pool, table)
    assert len(long.slots) == long.num_tokens + 2 * 3 + 1 + GROW_AHEAD

    pool, table, (short, long) = setup(capacity=20 + 1 + 8 - 1)  # 8 free once grown: too few
    grow_for_next_round([short, long], 3, pool, table)
    assert len(short.slots) == len(long.slots) == 10


def test_gathered_positions_tell_the_next_rounds_growth_when_none_is_due() -> None:
    """Given the round's gathered positions and slots, `grow_for_next_round` tells from them
    alone that no request must grow; slots gathered before a growth (fewer than held now) send
    it to the requests themselves, which grow only if they must."""
    pool, table = KVPool(200, 1, 1, 2, torch.float32, "cpu"), ReqToTokenPool(4, 64, "cpu")
    reqs = [Request(str(i), [1] * 5, SamplingParams(max_tokens=50)) for i in range(2)]
    for req in reqs:
        req.output_token_ids = [2, 2]  # num_tokens 7; the next round needs 7 + 2k + 1 = 14
        grow_holders(pool, table, [(req, 14)])

    def gathered(newest: list[int], held: list[int]) -> GatheredItems:
        return GatheredItems.from_lists(newest, held, [[], []])

    free = pool.allocator.num_free
    grow_for_next_round(reqs, 3, pool, table, gathered=gathered([6, 6], [14, 14]))
    grow_for_next_round(reqs, 3, pool, table, gathered=gathered([6, 6], [10, 14]))  # stale
    assert pool.allocator.num_free == free and [len(r.slots) for r in reqs] == [14, 14]
    reqs[0].output_token_ids.append(2)  # one position on: it must grow, and the other with it
    grow_for_next_round(reqs, 3, pool, table, gathered=gathered([7, 6], [14, 14]))
    assert [len(r.slots) for r in reqs] == [8 + 2 * 3 + 1 + GROW_AHEAD, 7 + 2 * 3 + 1 + GROW_AHEAD]
    assert table.req_to_token[reqs[0].row, : len(reqs[0].slots)].tolist() == reqs[0].slots


def test_requests_near_their_max_tokens_stay_on_the_device(models):
    """A request with fewer tokens left than K verifies its whole chain with acceptance stopped
    at its lookahead: no round of a greedy workload falls to the host, and output and
    statistics are the host round's."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 12))] for _ in range(8)]
    params = [
        # At least 3: a request with one token left after its prefill drafts no first chain.
        SamplingParams(max_tokens=rng.randint(3, 12), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    llm = _llm(models, "good", 3)
    device, rounds = _run(llm, prompts, params, True)
    host, _ = _run(_llm(models, "good", 3), prompts, params, False)
    assert device == host
    assert not [plan for plan in llm.engine.plan_counts() if plan.startswith("chain/host")]
    # Rounds where every request had one token left verify no draft and count no step.
    assert rounds >= max(steps for _, _, steps, _ in device)
    assert sum(len(tokens) < 5 for tokens, *_ in device) >= 2


def test_a_draft_extend_near_max_tokens_writes_only_its_own_slots(models, monkeypatch):
    """The fixed extend's rows past what a request may commit write the padding slot, never
    a slot its row tables held for an earlier request and that another one owns now: every
    depth's tables are poisoned with real slots, and each request's KV writes are checked
    against the slots its own sequence holds."""
    llm = _llm(models, "good", 3)
    worker = llm.engine.speculator
    writes: dict[int, list[list[int]]] = {}
    for d, depth in enumerate(worker.depths):
        table = depth.req_to_token_pool.req_to_token
        table[:] = torch.arange(1, table.shape[1] + 1)
        write = depth.kv_pool.write

        def recorded(layer, slots, k, v, d=d, write=write):
            writes.setdefault(d, []).append(slots.tolist())
            return write(layer, slots, k, v)

        monkeypatch.setattr(depth.kv_pool, "write", recorded)
    launch = worker.fixed_extend.launch
    checked = {"tail": 0}

    def checked_launch(items, *args):
        writes.clear()
        out = launch(items, *args)
        for d, per_call in writes.items():
            width = worker.fixed_extend.widths[d]
            for i, item in enumerate(items):
                own = set(item.state.seqs[d].slots) | {PADDING_SLOT}
                assert set(per_call[-1][i * width : (i + 1) * width]) <= own
                if item.num_positions is not None and item.num_positions < item.m + 4:
                    checked["tail"] += 1
        return out

    monkeypatch.setattr(worker.fixed_extend, "launch", checked_launch)
    prompts = [[5 + i] * 6 for i in range(6)]
    llm.generate(prompts, [SamplingParams(max_tokens=3 + i, temperature=0) for i in range(6)])
    assert checked["tail"] > 0


def test_slots_grow_a_few_rounds_ahead(models, monkeypatch):
    """The target's slots grow GROW_AHEAD positions past the next round's when they must grow,
    and each depth then takes all that the target holds: row tables are written once every
    few rounds, not every round (each write is a copy to the device and an indexed write)."""
    llm = _llm(models, "good", 3)
    worker = llm.engine.speculator
    tables = [llm.engine.runner.req_to_token_pool] + [d.req_to_token_pool for d in worker.depths]
    writes = {"n": 0}
    for table in tables:
        original = table.write_runs

        def counted(*args, original=original):
            writes["n"] += 1
            return original(*args)

        monkeypatch.setattr(table, "write_runs", counted)
    prompt = list(range(5, 25))
    llm.generate([prompt], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    rounds = _on_device(llm.engine.plan_counts())
    assert rounds >= 30
    # Every round writing every table would be 4 writes a round.
    assert writes["n"] * 2 <= rounds
