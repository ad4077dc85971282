import random

import pytest

from engine.allocator import PADDING_SLOT, SlotAllocator


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
    slots = alloc.allocate(2)
    alloc._free.append(slots[0])  # a slot both free and used
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
