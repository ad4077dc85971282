"""The draft depths' KV in the prefix cache (engine.engine_hooks.PrefixCompanion): a cached
prefix is reused only with every depth's KV of it.

Depth d at position i reads x_{i+d+1} (spec/runtime/draft_extend.py), so its KV there depends on the
K tokens after i (K depths) as well as on those up to i. A cached target slot stands for the
tokens of its tree path up to its position, and a position where paths part is shared by all of
them: so the depths' KV of position i is keyed by the target slot of position i + K on the path
that computed it, whose path fixes every token that KV read. It lives as long as that slot stays
in the cache, one slot in each depth per cached target slot at most. A match of L tokens gives
the depths' KV of its first L - K positions (`lag`), and the request holds the whole match.

A request that starts at a cached prefix S begins with every depth valid up to S over the
cache's slots, which is the state an extend starts from at a prompt's beginning, S positions
later: all depths start at one position, and no boundary state is needed. A request gives the
cache its depths' KV of position p with its target KV of p + K, where every depth holds KV of its
own computed from committed tokens at p (below each depth's valid length, in slots no parallel
sample shares)."""

from __future__ import annotations

from collections.abc import Callable

from engine.request import Request
from spec.runtime.draft_runner import DraftRunner, DraftSeq
from spec.runtime.state import SpecRequestState


class DraftPrefixCache:
    def __init__(
        self, depths: list[DraftRunner], new_state: Callable[[], SpecRequestState]
    ) -> None:
        self.depths = depths
        self.new_state = new_state
        self.lag = len(depths)
        # Cached target slot of position p -> each depth's slot of position p - lag on its path.
        self._slots: dict[int, tuple[int, ...]] = {}

    def cacheable_end(self, req: Request, end: int) -> int:
        state: SpecRequestState | None = req.spec_state
        start = req.cached_len
        if state is None:
            return start
        # The cache holds the depths' KV up to `cached`, keyed by target slots up to
        # cached + lag: at least every target slot the request holds of it (start).
        cached = state.cached_drafts
        if cached < start - self.lag:
            return start
        draft_end = end - self.lag
        for runner, seq in zip(self.depths, state.seqs, strict=True):
            if seq.shared > cached:
                # Positions past the cache's belong to another sequence (a fork's parent).
                return max(start, min(end, cached + self.lag))
            draft_end = min(draft_end, seq.valid_len, len(seq.slots))
            is_shared = runner.kv_pool.allocator.is_shared
            position = cached
            while position < draft_end and not is_shared(seq.slots[position]):
                position += 1
            draft_end = position
        return max(start, min(end, draft_end + self.lag))

    def adopt(self, req: Request, present: int, end: int) -> None:
        state: SpecRequestState = req.spec_state
        lag = self.lag
        # Draft positions the cache holds already: the request's own (`cached_drafts`) and
        # those keyed by the target slots it held before this insert (`present`), whose copies
        # here are freed (only a finishing request's insert finds more than it holds).
        held_end = max(state.cached_drafts, present - lag)
        taken_end = max(held_end, end - lag)
        columns = []
        for runner, seq in zip(self.depths, state.seqs, strict=True):
            if held_end > state.cached_drafts:
                runner.kv_pool.allocator.free(seq.slots[state.cached_drafts : held_end])
            columns.append(seq.slots[held_end:taken_end])
            # Its first positions are the cache's now: releasing the sequence keeps them.
            seq.shared = max(seq.shared, taken_end)
        keys = req.slots[held_end + lag : taken_end + lag]
        for i, target_slot in enumerate(keys):
            self._slots[target_slot] = tuple(column[i] for column in columns)
        state.cached_drafts = taken_end

    def evicted(self, target_slots: list[int]) -> None:
        kept = [self._slots.pop(slot) for slot in target_slots if slot in self._slots]
        for d, runner in enumerate(self.depths):
            runner.kv_pool.allocator.free([slots[d] for slots in kept])

    def matched(self, req: Request, target_slots: list[int]) -> None:
        if not req.num_draft_tokens:
            return  # it does not speculate: the target's KV is all it reads
        assert req.spec_state is None, "a request that holds no KV has no draft state"
        kept = [self._slots[slot] for slot in target_slots[self.lag : self.lag + req.cached_len]]
        state = self.new_state()
        req.spec_state = state
        for d, runner in enumerate(self.depths):
            state.seqs[d] = runner.cached_prefix([slots[d] for slots in kept])
        state.cached_drafts = len(kept)

    def unmatched(self, req: Request) -> None:
        state: SpecRequestState | None = req.spec_state
        if state is None:
            return
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
    nothing else, up to one position; -1 for any other state."""
    if state is None:
        return 0
    seqs: list[DraftSeq] = state.seqs
    start = seqs[0].valid_len
    if all(seq.valid_len == seq.shared == len(seq.slots) == start for seq in seqs):
        return start
    return -1
