"""Alternative chains in the verify forward: each is a span after its request's newest token, in
a spare row of the target's request table that holds the request's slots up to that token, so
it reads the request's cached KV without holding it. The newest token's KV there is what the
main span writes in the same forward: every layer writes the batch's KV before it attends.

They live within one verify step. When one wins, the request takes over the slots holding its
accepted drafts' KV and the alternative takes (to free) the slots they replace: no KV moves, so
no queued copy reads slots that are already free (on a decode node, a transfer on another stream
may be writing them)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_pool import KVPool, ReqToTokenPool
from engine.request import Request
from spec.batching import Span


@dataclass
class Alternative:
    chain: list[int]
    span: Span
    index: int  # its span's place in the verify batch


def take_alternatives(
    requests: list[Request],
    chains: list[list[int]],
    pool: ReqToTokenPool,
    kv_pool: KVPool,
    first_index: int,
    taken: list[list[Alternative]],
) -> None:
    """Spans for the alternative chains of the greedy requests that verify `chains`, numbered
    from `first_index`; taken[i] gets request i's. None this step where the rows or slots are
    not free. Fills `taken` as it takes rows and slots, so the caller can always release them."""
    wanted = [
        (i, alt[: len(chain)])
        for i, (req, chain) in enumerate(zip(requests, chains))
        if chain and req.params.greedy
        for alt in req.spec_state.alt_chains
    ]
    allocator = kv_pool.allocator
    needed = sum(len(alt) for _, alt in wanted)
    if not wanted or pool.num_free_rows < len(wanted) or not allocator.can_allocate(needed):
        return
    pairs, writes, longest = [], [], 0
    for index, (i, alt) in enumerate(wanted, start=first_index):
        req = requests[i]
        start = req.num_tokens  # the newest token's position + 1
        row, slots = pool.allocate_row(), allocator.allocate(len(alt))
        taken[i].append(Alternative(alt, Span(row, start, alt, slots), index))
        pairs.append((req.row, row))
        writes.append((row, start, slots))
        longest = max(longest, start)
    pool.copy_prefixes(pairs, longest)
    pool.write_many(writes)


def release_alternatives(
    taken: list[list[Alternative]], pool: ReqToTokenPool, kv_pool: KVPool
) -> None:
    for alternatives in taken:
        for alt in alternatives:
            pool.free_row(alt.span.row)
            kv_pool.allocator.free(alt.span.slots)


def take_slots(req: Request, alt: Alternative, count: int) -> tuple[int, int, list[int]]:
    """`req` keeps `alt`'s first `count` drafts: it takes their slots and gives `alt` the ones
    they replace. Returns the request's row-table write."""
    first = req.num_tokens  # positions m+1, ...
    own = req.slots[first : first + count]
    req.slots[first : first + count] = alt.span.slots[:count]
    alt.span.slots[:count] = own
    return req.row, first, req.slots[first : first + count]
