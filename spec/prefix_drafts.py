"""The draft depths' KV in the prefix cache (engine.engine_hooks.PrefixCompanion): a cached
prefix is reused only with every depth's KV of it, so each cached target position keeps one slot
in each depth's pool, keyed by its target slot, for as long as the cache holds that slot.

Depth d at position i reads x_{i+d+1} (spec/draft_extend.py), so its KV there depends on the
tokens up to K positions ahead (K depths). A match of L tokens is therefore used for its first
L - K positions only (`lag`): there every depth's cached KV read the matched tokens alone. A
request that starts at a cached prefix S begins with every depth valid up to S over the cache's
slots, which is the state an extend starts from at a prompt's beginning, S positions later: all
depths start at one position, and no boundary state is needed.

A position enters the cache only where every depth holds KV of its own computed from committed
tokens (below each depth's valid length, in slots no parallel sample shares)."""

from __future__ import annotations

from collections.abc import Callable

from engine.request import Request
from spec.draft_runner import DraftRunner, DraftSeq
from spec.state import SpecRequestState


class DraftPrefixCache:
    def __init__(
        self, depths: list[DraftRunner], new_state: Callable[[], SpecRequestState]
    ) -> None:
        self.depths = depths
        self.new_state = new_state
        self.lag = len(depths)
        # Cached target slot -> its position's slot in each depth, depth 0 first.
        self._slots: dict[int, tuple[int, ...]] = {}

    def cacheable_end(self, req: Request, end: int) -> int:
        state: SpecRequestState | None = req.spec_state
        start = req.cached_len
        if state is None or any(seq.shared < start for seq in state.seqs):
            # No draft KV, or a sequence whose first positions are not the cache's.
            return start
        for runner, seq in zip(self.depths, state.seqs, strict=True):
            end = min(end, seq.valid_len, len(seq.slots))
            is_shared = runner.kv_pool.allocator.is_shared
            position = start
            while position < end and not is_shared(seq.slots[position]):
                position += 1
            end = position
        return max(start, end)

    def adopt(self, req: Request, present: int, end: int) -> None:
        state: SpecRequestState = req.spec_state
        start = req.cached_len
        columns = []
        for runner, seq in zip(self.depths, state.seqs, strict=True):
            if present > start:
                # The cache held these positions already: this request's copies go.
                runner.kv_pool.allocator.free(seq.slots[start:present])
            columns.append(seq.slots[present:end])
            # The first `end` slots are the cache's now: releasing the sequence keeps them.
            seq.shared = max(seq.shared, end)
        for i, target_slot in enumerate(req.slots[present:end]):
            self._slots[target_slot] = tuple(column[i] for column in columns)

    def evicted(self, target_slots: list[int]) -> None:
        kept = [self._slots.pop(slot) for slot in target_slots]
        for d, runner in enumerate(self.depths):
            runner.kv_pool.allocator.free([slots[d] for slots in kept])

    def matched(self, req: Request, target_slots: list[int]) -> None:
        assert req.spec_state is None, "a request that holds no KV has no draft state"
        kept = [self._slots[slot] for slot in target_slots]
        state = self.new_state()
        req.spec_state = state
        for d, runner in enumerate(self.depths):
            state.seqs[d] = runner.cached_prefix([slots[d] for slots in kept])

    def unmatched(self, req: Request) -> None:
        state: SpecRequestState = req.spec_state
        for runner, seq in zip(self.depths, state.seqs, strict=True):
            runner.release(seq)
        req.spec_state = None

    def cached_slots(self, depth: int) -> list[int]:
        """The slots of depth `depth` that the cache holds (the KV audit counts them)."""
        return [slots[depth] for slots in self._slots.values()]

    def __len__(self) -> int:
        return len(self._slots)


def starts_at_cached_prefix(state: SpecRequestState | None) -> int:
    """Where a request's draft starts over a prompt: the cached prefix every depth holds (0
    without one). A state that `DraftPrefixCache.matched` made has every depth valid, and
    nothing else, up to one position."""
    if state is None:
        return 0
    seqs: list[DraftSeq] = state.seqs
    start = seqs[0].valid_len
    if all(seq.valid_len == seq.shared == len(seq.slots) == start for seq in seqs):
        return start
    return -1
