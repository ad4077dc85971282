"""Slot allocator for the paged KV cache (page size 1), in plain Python.

Invariants (checked by `check_integrity`, tested in tests/test_allocator.py):
- slot 0 is never handed out: it is the padding slot that dummy and padded tokens write to;
- every other slot is either free or allocated, never both, never twice;
- `num_free + num_used == capacity`.
"""

from __future__ import annotations

from collections.abc import Iterable

PADDING_SLOT = 0


class SlotAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a KV pool needs at least one usable slot, got capacity={capacity}")
        self.capacity = capacity
        # Popping from the end hands out low slot numbers first, which keeps tests readable.
        self._free: list[int] = list(range(capacity, PADDING_SLOT, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} KV slots, {len(self._free)} free")
        if n == 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        self._used.update(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise ValueError("the same slot freed twice in one call")
        for slot in slots:
            if slot not in self._used:
                raise ValueError(f"slot {slot} freed but not allocated")
        self._used.difference_update(slots)
        self._free.extend(slots)

    def check_integrity(self) -> None:
        free = set(self._free)
        problems = []
        if len(free) != len(self._free):
            problems.append("a slot is listed free twice")
        if free & self._used:
            problems.append(f"slots both free and used: {sorted(free & self._used)[:8]}")
        if PADDING_SLOT in free or PADDING_SLOT in self._used:
            problems.append("the padding slot was handed out")
        if len(free) + len(self._used) != self.capacity:
            problems.append(
                f"{len(free)} free + {len(self._used)} used != capacity {self.capacity}"
            )
        if problems:
            raise AssertionError("KV slot allocator corrupt: " + "; ".join(problems))
