"""Slot allocator for the paged KV cache (page size 1), in plain Python.

Invariants (checked by `check_integrity`, tested in tests/test_allocator.py):
- slot 0 is never handed out: it is the padding slot that dummy and padded tokens write to;
- every other slot is either free or allocated, never both, never twice;
- `num_free + num_used == capacity`.

A request's slots come out ascending, and as one contiguous run whenever some free run is long
enough: the free slots are kept as maximal runs (merged again as slots come back) and an
allocation takes the lowest run that holds it whole. A KV transfer moves such a run as a plain
slice of the pool instead of gathering and scattering it (metadata.wire). Handing out single
free slots from a stack instead scrambles their order within a few batches of requests, after
which almost no request gets a contiguous run.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Protocol

PADDING_SLOT = 0


def _runs(slots: set[int]) -> Iterator[tuple[int, int]]:
    """The distinct `slots` as maximal runs [start, end), ascending."""
    low, high = min(slots), max(slots)
    if high - low == len(slots) - 1:  # the usual case: one request's one run
        yield low, high + 1
        return
    ordered = sorted(slots)
    start = prev = ordered[0]
    for slot in ordered[1:]:
        if slot != prev + 1:
            yield start, prev + 1
            start = slot
        prev = slot
    yield start, prev + 1


class Reclaimer(Protocol):
    def reclaimable(self) -> int:
        """Used slots that no one needs."""

    def reclaim(self, num_slots: int) -> None:
        """Free at least `num_slots` of them into the allocator (fewer if there are not so
        many)."""


class SlotAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a KV pool needs at least one usable slot, got capacity={capacity}")
        self.capacity = capacity
        # The free slots as maximal runs [start, end): the starts ascending, each run's end.
        self._starts: list[int] = [PADDING_SLOT + 1]
        self._ends: dict[int, int] = {PADDING_SLOT + 1: capacity + 1}
        self._num_free = capacity
        self._used: set[int] = set()
        # Slots with more than one holder (parallel samples sharing their prompt's KV): how
        # many. A slot not here has one holder while used.
        self._holders: dict[int, int] = {}
        # What frees used slots that no one needs when an allocation is short (the prefix
        # cache's unheld slots, engine.scheduling.kv_cache); None: nothing does.
        self.reclaimer: Reclaimer | None = None

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return len(self._used)

    def reclaimable(self) -> int:
        """Used slots an allocation may take back (`reclaimer`)."""
        return self.reclaimer.reclaimable() if self.reclaimer is not None else 0

    def can_allocate(self, n: int) -> bool:
        """Whether `n` slots fit, counting the ones an allocation would reclaim."""
        return 0 <= n <= self._num_free + self.reclaimable()

    def allocate(self, n: int) -> list[int]:
        if n > self._num_free and self.reclaimer is not None:
            self.reclaimer.reclaim(n - self._num_free)
        if not 0 <= n <= self._num_free:
            raise MemoryError(f"asked for {n} KV slots, {self._num_free} free")
        if n == 0:
            return []
        starts, ends = self._starts, self._ends
        for i, start in enumerate(starts):
            end = ends[start]
            if end - start >= n:
                del ends[start]
                if end - start == n:
                    del starts[i]
                else:
                    starts[i] = start + n
                    ends[start + n] = end
                slots = list(range(start, start + n))
                break
        else:
            # No run is long enough: the lowest runs, in order, so the slots still ascend.
            slots, taken = [], 0
            while len(slots) < n:
                start = starts[taken]
                end = ends.pop(start)
                take = min(end - start, n - len(slots))
                slots.extend(range(start, start + take))
                taken += 1
                if start + take < end:  # the last run taken keeps its tail
                    taken -= 1
                    starts[taken] = start + take
                    ends[start + take] = end
            del starts[:taken]
        self._num_free -= n
        self._used.update(slots)
        return slots

    def share(self, slots: Iterable[int]) -> None:
        """One more holder for each of these used slots: a `free` by one holder keeps them
        used until the last holder frees them."""
        slots = list(slots)
        if not set(slots) <= self._used:
            stray = next(slot for slot in slots if slot not in self._used)
            raise ValueError(f"slot {stray} shared but not allocated")
        for slot in slots:
            self._holders[slot] = self._holders.get(slot, 1) + 1

    def is_shared(self, slot: int) -> bool:
        """Whether more than one holder holds this slot (`share`)."""
        return slot in self._holders

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        if self._holders:
            slots = self._drop_holders(slots)
        if not slots:
            return
        distinct = set(slots)
        if len(distinct) != len(slots):
            raise ValueError("the same slot freed twice in one call")
        if not distinct <= self._used:
            stray = next(slot for slot in slots if slot not in self._used)
            raise ValueError(f"slot {stray} freed but not allocated")
        self._used -= distinct
        self._num_free += len(slots)
        for start, end in _runs(distinct):
            self._add_run(start, end)

    def _drop_holders(self, slots: list[int]) -> list[int]:
        """One holder fewer for each shared slot; returns the slots this free releases."""
        released = []
        for slot in slots:
            holders = self._holders.get(slot)
            if holders is None:
                released.append(slot)
            elif holders == 2:
                del self._holders[slot]
            else:
                self._holders[slot] = holders - 1
        return released

    def _add_run(self, start: int, end: int) -> None:
        """Give back [start, end), merging it with the free runs it touches."""
        starts, ends = self._starts, self._ends
        k = bisect.bisect_left(starts, start)
        if k < len(starts) and starts[k] == end:
            end = ends.pop(end)
            del starts[k]
        if k > 0 and ends[starts[k - 1]] == start:
            ends[starts[k - 1]] = end
        else:
            starts.insert(k, start)
            ends[start] = end

    def free_runs(self) -> list[tuple[int, int]]:
        """The free slots as maximal runs [start, end), ascending."""
        return [(start, self._ends[start]) for start in self._starts]

    def check_integrity(self) -> None:
        problems = []
        free: set[int] = set()
        previous_end = PADDING_SLOT + 1
        if sorted(self._ends) != self._starts:
            problems.append("the free runs' starts and ends disagree")
        for start in self._starts:
            end = self._ends.get(start, start)
            if start < previous_end or end <= start:
                problems.append(f"free run [{start}, {end}) overlaps another or is empty")
            previous_end = max(previous_end, end)
            free.update(range(start, end))
        if free & self._used:
            problems.append(f"slots both free and used: {sorted(free & self._used)[:8]}")
        if not self._holders.keys() <= self._used:
            problems.append("shared slots that are not used")
        if PADDING_SLOT in free or PADDING_SLOT in self._used:
            problems.append("the padding slot was handed out")
        if max(free | self._used, default=0) > self.capacity:
            problems.append(f"a slot above capacity {self.capacity} is tracked")
        if len(free) != self._num_free:
            problems.append(f"{len(free)} slots in free runs, but num_free is {self._num_free}")
        if len(free) + len(self._used) != self.capacity:
            problems.append(
                f"{len(free)} free + {len(self._used)} used != capacity {self.capacity}"
            )
        if problems:
            raise AssertionError("KV slot allocator corrupt: " + "; ".join(problems))
