"""KV slot bookkeeping for requests: rows, slots, release. The one place that mutates both pools'
allocation state, so a request's `slots` and its req_to_token row always agree."""

from __future__ import annotations

from engine.kv_pool import KVPool, ReqToTokenPool, grow_holders
from engine.request import Request


class KVCacheManager:
    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        max_requests: int | None = None,
    ) -> None:
        """`max_requests`: rows requests may hold (default: all). The rest stay free for
        speculative decoding's alternative chains, which take rows within a step only."""
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.max_requests = req_to_token_pool.max_reqs if max_requests is None else max_requests

    @property
    def num_free_slots(self) -> int:
        return self.kv_pool.allocator.num_free

    @property
    def capacity(self) -> int:
        return self.kv_pool.capacity

    def can_grow(self, num_slots: int, num_new_rows: int = 0) -> bool:
        rows = self.req_to_token_pool
        held = rows.max_reqs - rows.num_free_rows
        return (
            self.kv_pool.allocator.can_allocate(num_slots)
            and held + num_new_rows <= self.max_requests
        )

    def grow(self, req: Request, num_slots: int) -> None:
        """Give `req` slots for its next `num_slots` tokens, taking a row first if it has none."""
        self.grow_many([(req, num_slots)])

    def grow_many(self, grants: list[tuple[Request, int]]) -> None:
        """`grow` for several requests, with one write to the row table."""
        grow_holders(self.kv_pool, self.req_to_token_pool, grants)

    def fork(self, source: Request, forks: list[Request], length: int) -> None:
        """Give each of `forks` (requests holding nothing) the first `length` slots of `source`,
        shared (`SlotAllocator.share`), in a row of its own: parallel samples of one prompt read
        its KV from one copy, and each appends its own tokens after it."""
        shared = source.slots[:length]
        writes = []
        for req in forks:
            assert req.row is None and not req.slots, "a fork holds nothing of its own"
            self.kv_pool.allocator.share(shared)
            req.row = self.req_to_token_pool.allocate_row()
            req.slots = list(shared)
            writes.append((req.row, 0, req.slots))
        self.req_to_token_pool.write_many(writes)

    def release(self, req: Request) -> None:
        if req.slots:
            self.kv_pool.allocator.free(req.slots)
        if req.row is not None:
            self.req_to_token_pool.free_row(req.row)
        req.slots = []
        req.row = None
        req.kv_len = 0

    def is_empty(self) -> bool:
        allocator = self.kv_pool.allocator
        allocator.check_integrity()
        rows_free = self.req_to_token_pool.num_free_rows == self.req_to_token_pool.max_reqs
        return allocator.num_used == 0 and rows_free
