"""A verify's draws and KV slots.

`target_draws`: the token the target draws at each row of a sampled request's span.

`TreeSlots`: a request holds slots for the positions after its newest token as far as its
lookahead; a tree's nodes past those take slots of their own for the step. The nodes of the
accepted path then hold the KV the request keeps, at the positions of their levels: the
request takes over their slots there, and gives the ones they replace to be freed with the
nodes it does not keep. No KV moves, so no queued copy reads slots that are already free (on
a decode node, a transfer on another stream may be writing them)."""

from __future__ import annotations

import torch

from engine.executor.host_copy import int_tensor
from engine.request import Request
from engine.sampling.sampler import sample_on_device
from engine.sampling.step_sampling import position_seed
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from spec.runtime.tree import DraftTree


class TreeSlots:
    """The slots one verify step took past the requests' own, freed after it."""

    def __init__(self, kv_pool: KVPool, pool: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.pool = pool
        self.slots: list[int] = []
        self.writes: list[tuple[int, int, list[int]]] = []  # row-table writes, one copy for all

    def span_slots(self, req: Request, num_nodes: int) -> list[int]:
        """Slots for `req`'s newest token and up to `num_nodes` nodes after it: the request's
        own, then new ones where the pool and the request's row have room. Fewer than
        1 + num_nodes where they do not: the tree is cut to fit."""
        m = req.num_tokens - 1
        own = req.slots[m : m + 1 + num_nodes]
        wanted = min(1 + num_nodes - len(own), self.pool.req_to_token.shape[1] - m - len(own))
        if wanted <= 0 or not self.kv_pool.allocator.can_allocate(wanted):
            return own
        extra = self.kv_pool.allocator.allocate(wanted)
        self.slots += extra
        self.writes.append((req.row, m + len(own), extra))
        return own + extra

    def write(self) -> None:
        """The new slots into the requests' rows, before the forward that reads them."""
        self.pool.write_many(self.writes)
        self.writes = []

    def keep_path(self, req: Request, span_slots: list[int], path: list[int]) -> tuple | None:
        """`req` keeps the KV of the accepted nodes `path` (level 1 first): their slots go to
        positions m+1, m+2, ... Returns the request's row-table write, None if nothing moved."""
        if path == list(range(len(path))):
            return None
        m = req.num_tokens - 1
        own_count = min(len(req.slots) - m - 1, len(span_slots) - 1)
        own = span_slots[1 : 1 + own_count]
        kept = [span_slots[node + 1] for node in path]
        chosen, owned = set(kept), set(own)
        rest = [slot for slot in own if slot not in chosen]
        new = kept + rest[: own_count - len(kept)]
        placed = set(new)
        given = [slot for slot in own if slot not in placed]
        gained = {slot for slot in kept if slot not in owned}
        self.slots = [slot for slot in self.slots if slot not in gained] + given
        req.slots[m + 1 : m + 1 + own_count] = new
        return req.row, m + 1, new

    def free(self) -> None:
        if self.slots:
            self.kv_pool.allocator.free(self.slots)
            self.slots = []


def target_draws(
    requests: list[Request],
    trees: list[DraftTree],
    logits: torch.Tensor,
    starts: list[int],
    default_generator: torch.Generator,
) -> dict[int, list[int]]:
    """For each sampled request (by its index), the token the target draws at every row of its
    span: a row of level l draws output token l of this step, from the generator plain decoding
    would use for it. One draw for all rows of all requests."""
    rows: list[int] = []
    params, generators = [], []
    owners: list[int] = []
    for i, (req, tree) in enumerate(zip(requests, trees)):
        if req.params.greedy:
            continue
        seed, done = req.params.seed, len(req.output_token_ids)
        for r, level in enumerate([0, *tree.levels]):
            rows.append(starts[i] + r)
            params.append(req.params)
            generators.append(None if seed is None else position_seed(seed, done + level))
        owners.append(i)
    if not rows:
        return {}
    index = int_tensor(rows, logits.device)
    drawn = sample_on_device(logits.index_select(0, index), params, generators, default_generator)
    flat = drawn.tolist()
    draws, offset = {}, 0
    for i in owners:
        count = len(trees[i]) + 1
        draws[i], offset = flat[offset : offset + count], offset + count
    return draws
