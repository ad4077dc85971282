import random

import pytest
import torch

from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.allocator import PADDING_SLOT, SlotAllocator
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool, grow_holders


def test_allocate_and_free_keep_counts():
    alloc = SlotAllocator(10)
    a = alloc.allocate(4)
    b = alloc.allocate(6)
    assert alloc.num_free == 0 and alloc.num_used == 10
    assert len(set(a) | set(b)) == 10
    assert PADDING_SLOT not in a + b
    assert not alloc.can_allocate(1)
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.can_allocate(4) and not alloc.can_allocate(5)
    alloc.check_integrity()


def test_over_allocation_and_bad_frees_are_refused():
    alloc = SlotAllocator(3)
    with pytest.raises(MemoryError):
        alloc.allocate(4)
    slots = alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.free([slots[0], slots[0]])
    alloc.free([slots[0]])
    with pytest.raises(ValueError):
        alloc.free([slots[0]])
    with pytest.raises(ValueError):
        alloc.free([PADDING_SLOT])
    alloc.check_integrity()


def test_integrity_check_catches_corruption():
    alloc = SlotAllocator(4)
    alloc.allocate(2)
    alloc._used.add(4)  # a slot both free and used
    with pytest.raises(AssertionError, match="both free and used"):
        alloc.check_integrity()


def test_random_workload_never_breaks_invariants():
    rng = random.Random(0)
    alloc = SlotAllocator(64)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 9)
            if alloc.can_allocate(n):
                held.append(alloc.allocate(n))
        alloc.check_integrity()
        assert alloc.num_used == sum(map(len, held))
    for slots in held:
        alloc.free(slots)
    assert alloc.num_free == 64


def is_run(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


def test_a_fresh_pool_hands_out_ascending_contiguous_runs():
    alloc = SlotAllocator(100)
    assert alloc.allocate(10) == list(range(1, 11))
    assert alloc.allocate(1) == [11]
    assert alloc.allocate(30) == list(range(12, 42))


def test_freed_slots_merge_back_into_runs_whatever_the_order():
    alloc = SlotAllocator(50)
    held = [alloc.allocate(n) for n in (5, 7, 3, 11, 2)]
    for i in (2, 0, 4, 1, 3):
        alloc.free(held[i])
        alloc.check_integrity()
    assert alloc.free_runs() == [(1, 51)]
    # A request's slots freed in any order, as one list of several runs.
    a, b, c = alloc.allocate(4), alloc.allocate(4), alloc.allocate(4)
    alloc.free(c[::-1] + a)
    assert alloc.free_runs() == [(1, 5), (9, 51)]
    alloc.free(b)
    assert alloc.free_runs() == [(1, 51)]


@pytest.mark.parametrize("finish", ["in_order", "random"])
def test_allocate_free_cycles_keep_handing_out_contiguous_runs(finish: str):
    """Batches of prompts freed in the order they were sent (a prefill node), or requests that
    finish in any order (a decode node): every allocation that some free run can hold whole
    comes out as one ascending contiguous run, and the lowest such run."""
    rng = random.Random(7)
    alloc = SlotAllocator(20_000)
    live: list[list[int]] = []
    allocations = contiguous = 0
    for _ in range(600):
        if finish == "in_order":
            for slots in live:
                alloc.free(slots)
            live = []
            batch = [rng.randint(50, 2000) for _ in range(rng.randint(1, 6))]
        else:
            while live and (alloc.num_used > 15_000 or rng.random() < 0.5):
                alloc.free(live.pop(rng.randrange(len(live))))
            batch = [rng.randint(50, 2000)]
        for n in batch:
            fitting = [start for start, end in alloc.free_runs() if end - start >= n]
            slots = alloc.allocate(n)
            live.append(slots)
            assert slots == sorted(slots)
            if fitting:
                assert slots == list(range(fitting[0], fitting[0] + n))
            allocations += 1
            contiguous += is_run(slots)
        alloc.check_integrity()
    share = contiguous / allocations
    assert share == 1.0 if finish == "in_order" else share > 0.9, share


def test_without_a_long_enough_run_the_lowest_runs_are_taken_in_order():
    alloc = SlotAllocator(20)
    held = [alloc.allocate(4) for _ in range(5)]  # 1-4, 5-8, 9-12, 13-16, 17-20
    alloc.free(held[1])
    alloc.free(held[3])
    slots = alloc.allocate(6)
    assert slots == [5, 6, 7, 8, 13, 14]
    assert alloc.free_runs() == [(15, 17)]
    alloc.check_integrity()


def test_row_table_writes_in_one_go_equal_one_by_one() -> None:
    entries = [(0, 0, [5, 6, 7]), (2, 4, [9]), (1, 1, []), (0, 3, [11, 12])]
    together = ReqToTokenPool(3, 8, "cpu")
    together.write_many(entries)
    apart = ReqToTokenPool(3, 8, "cpu")
    for row, start, slots in entries:
        if slots:
            apart.write(row, start, slots)
    assert torch.equal(together.req_to_token, apart.req_to_token)
    assert together.req_to_token[0, :5].tolist() == [5, 6, 7, 11, 12]


def test_a_requests_token_slice_spans_prompt_and_output() -> None:
    req = Request("r", [1, 2, 3], SamplingParams())
    req.output_token_ids += [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids(start, end) == req.all_token_ids[start:end]


def test_growing_several_holders_takes_all_their_slots_or_none() -> None:
    """One allocation for every holder of a step, in order, each one's new slots written after
    its old ones in its row; when they do not all fit, nobody's slots change."""
    pool = KVPool(12, 1, 1, 2, torch.float32, "cpu")
    table = ReqToTokenPool(3, 16, "cpu")
    first, second = Request("a", [1], SamplingParams()), Request("b", [1], SamplingParams())
    grow_holders(pool, table, [(first, 3), (second, 0)])
    grow_holders(pool, table, [(first, 2), (second, 4)])
    assert first.slots == [1, 2, 3, 4, 5] and second.slots == [6, 7, 8, 9]
    assert second.row is not None  # a holder granted nothing yet still has its row
    assert table.req_to_token[first.row, :5].tolist() == first.slots
    assert table.req_to_token[second.row, :4].tolist() == second.slots
    with pytest.raises(MemoryError):
        grow_holders(pool, table, [(first, 2), (second, 2)])  # 4 asked, 3 free
    assert first.slots == [1, 2, 3, 4, 5] and second.slots == [6, 7, 8, 9]
    assert pool.allocator.num_free == 3
    pool.allocator.check_integrity()


def test_growth_from_one_free_run_or_from_several_writes_every_holders_slots() -> None:
    """Growths whose slots come from one free run, and growths whose slots come from several
    (a nearly full pool, fragmented by frees), leave each holder's row table entries equal to
    its slots, whatever form the slots reach the table in."""
    rng = random.Random(3)
    pool = KVPool(40, 1, 1, 2, torch.float32, "cpu")
    table = ReqToTokenPool(8, 64, "cpu")
    holders = [Request(str(i), [1], SamplingParams()) for i in range(8)]
    allocate, taken = pool.allocator.allocate, []
    pool.allocator.allocate = lambda n: taken.append(allocate(n)) or taken[-1]
    for _ in range(40):
        grants = [(h, rng.randint(0, 2)) for h in holders]
        if sum(n for _, n in grants) <= pool.allocator.num_free:
            grow_holders(pool, table, grants)
        victim = rng.choice(holders)  # frees leave holes the next growths fill
        if victim.row is not None:
            pool.allocator.free(victim.slots)
            table.free_row(victim.row)
            victim.slots, victim.row = [], None
        for h in holders:
            if h.row is not None:
                assert table.req_to_token[h.row, : len(h.slots)].tolist() == h.slots
    runs = [slots for slots in taken if slots]
    assert any(s[-1] - s[0] == len(s) - 1 for s in runs)  # one free run
    assert any(s[-1] - s[0] > len(s) - 1 for s in runs)  # several
    pool.allocator.check_integrity()
