"""KV slot bookkeeping for requests: rows, slots, release, and the prefix cache. The one place
that mutates both pools' allocation state, so a request's `slots` and its req_to_token row
always agree.

With a prefix cache (engine.scheduling.prefix_cache), a request's slots begin with the cache's
(`Request.cached_len` of them, held through `Request.cache_node`) and go on with its own. Its
computed KV moves into the cache when its prompt (or a chunk) is prefilled and when it lets its
slots go; only the KV of tokens below `kv_len` is ever cached, and never that of a request
whose forward failed. Slots that parallel samples share (`SlotAllocator.share`) stay out of the
cache until their last holder lets them go, so the cache never owns a slot someone else frees.
A live request's slots never change (a begun transfer may read them): where two requests
computed the same tokens, the second keeps its copy until it lets go. Cached slots without
holds count as room: a step that needs them evicts them.

A speculating engine caches its draft depths' KV beside the target's (`PrefixCompanion`):
the drafts' KV of a position enters the cache with the target's `lag` positions later, and a
match gives up its last `lag` positions."""

from __future__ import annotations

from engine.engine_hooks import PrefixCompanion
from engine.request import Request
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool, grow_holders
from engine.scheduling.prefix_cache import PrefixCache

# The fewest slots an eviction frees when it runs (fewer where no more are free of holds).
EVICT_AT_LEAST = 256


class KVCacheManager:
    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        max_requests: int | None = None,
        prefix_cache: PrefixCache | None = None,
        companion: PrefixCompanion | None = None,
    ) -> None:
        """`max_requests`: rows requests may hold (default: all). The rest stay free for
        speculative decoding's alternative chains, which take rows within a step only.
        `prefix_cache`: None runs without one. `companion`: the KV of other pools cached with
        the target's (a speculator's draft depths)."""
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.max_requests = req_to_token_pool.max_reqs if max_requests is None else max_requests
        self.prefix_cache = prefix_cache
        self.companion = companion if prefix_cache is not None else None
        if prefix_cache is not None:
            # Every allocation from the pool (a speculative round's slots too) may evict.
            kv_pool.allocator.reclaimer = self
        # Tokens looked up in the prefix cache at admission, and those found there.
        self.lookup_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_slots(self) -> int:
        """Slots a request may take: free ones, and cached ones no request holds (evicted
        when taken)."""
        return self.kv_pool.allocator.num_free + self._evictable()

    @property
    def num_used_slots(self) -> int:
        """Slots requests hold (a node's load): the used ones less those only the cache keeps."""
        return self.kv_pool.capacity - self.num_free_slots

    @property
    def capacity(self) -> int:
        return self.kv_pool.capacity

    def _evictable(self) -> int:
        return self.prefix_cache.evictable_size if self.prefix_cache is not None else 0

    def reclaimable(self) -> int:
        return self._evictable()

    def reclaim(self, num_slots: int) -> None:
        """Evict at least `num_slots` unheld cached slots
        (engine.scheduling.allocator.Reclaimer)."""
        assert self.prefix_cache is not None
        # An eviction walks the whole tree: with the pool full of cache, taking just what a
        # decode step lacks would walk it at every step.
        evicted = self.prefix_cache.evict(max(num_slots, EVICT_AT_LEAST))
        if self.companion is not None:
            self.companion.evicted(evicted)
        self.kv_pool.allocator.free(evicted)

    def can_grow(self, num_slots: int, num_new_rows: int = 0) -> bool:
        rows = self.req_to_token_pool
        held = rows.max_reqs - rows.num_free_rows
        return 0 <= num_slots <= self.num_free_slots and held + num_new_rows <= self.max_requests

    def grow(self, req: Request, num_slots: int) -> None:
        """Give `req` slots for its next `num_slots` tokens, taking a row first if it has none."""
        self.grow_many([(req, num_slots)])

    def grow_many(self, grants: list[tuple[Request, int]]) -> None:
        """`grow` for several requests, with one write to the row table for the new slots."""
        # The allocation evicts unheld cached slots where the free ones are short (`reclaim`).
        # A request that starts at a cached prefix holds its slots, but no row yet.
        writes = []
        for req, _ in grants:
            if req.row is None and req.slots:
                req.row = self.req_to_token_pool.allocate_row()
                writes.append((req.row, 0, req.slots))
        self.req_to_token_pool.write_many(writes)
        grow_holders(self.kv_pool, self.req_to_token_pool, grants)

    def match_prefix(self, req: Request) -> bool:
        """Start `req`, which holds nothing, at the longest cached prefix of its tokens but the
        last (whose logits it needs), holding that prefix; False, changing nothing, where it
        cannot use the cache (none, or a prompt given partly as vectors). The slots come with
        a row at `grow`; `unmatch` undoes this for a request not admitted after all."""
        cache = self.prefix_cache
        if cache is None or req.prompt_embeds is not None or req.slots or req.row is not None:
            return False
        tokens = req.token_ids(0, req.num_tokens - 1)
        match = cache.match(tokens)
        used = match.length
        if self.companion is not None:
            used = max(0, used - self.companion.lag)
        # The whole match is held: the companion's KV of the positions used is keyed by the
        # target slots after them.
        cache.lock(match.node)
        req.slots = match.slots[:used]
        req.kv_len = req.cached_len = used
        req.cache_node = match.node
        if not req.output_token_ids:
            req.cached_tokens = used
        self.lookup_tokens += len(tokens)
        self.hit_tokens += used
        if self.companion is not None and used:
            self.companion.matched(req, match.slots)
        return True

    def unmatch(self, req: Request) -> None:
        """Undo `match_prefix` (the request was not admitted)."""
        assert self.prefix_cache is not None and req.row is None
        self.lookup_tokens -= req.num_tokens - 1
        self.hit_tokens -= req.cached_len
        self.prefix_cache.unlock(req.cache_node)
        if self.companion is not None and req.cached_len:
            self.companion.unmatched(req)
        if not req.output_token_ids:
            req.cached_tokens = 0
        req.slots, req.kv_len, req.cached_len, req.cache_node = [], 0, 0, None

    def cache_prefix(self, req: Request) -> None:
        """Move `req`'s computed KV (its tokens below kv_len, up to the first slot it shares)
        into the cache, and hold it there. A live request's slots never change under it (a
        begun transfer may be reading them): where the cache already holds more of its tokens
        than it reads from there, it keeps its own copy until it lets go (`release`)."""
        end = self._cacheable_end(req)
        if end == req.cached_len:
            return
        cache = self.prefix_cache
        assert cache is not None
        tokens = req.token_ids(0, end)
        if cache.match(tokens).length > req.cached_len:
            return
        cache.insert(tokens, req.slots[:end])
        if self.companion is not None:
            self.companion.adopt(req, req.cached_len, end)
        node = cache.match(tokens).node
        cache.lock(node)
        cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, end

    def _cacheable_end(self, req: Request) -> int:
        """Where the KV that `req` may give the cache ends: its computed tokens, up to the
        first slot it shares with parallel samples; `cached_len` where it gives none."""
        if self.prefix_cache is None or req.prompt_embeds is not None or req.cache_node is None:
            return req.cached_len
        is_shared = self.kv_pool.allocator.is_shared
        end = req.cached_len
        while end < req.kv_len and not is_shared(req.slots[end]):
            end += 1
        if self.companion is not None and end > req.cached_len:
            end = self.companion.cacheable_end(req, end)
        return end

    def fork(self, source: Request, forks: list[Request], length: int) -> None:
        """Give each of `forks` (requests holding nothing) the first `length` slots of `source`
        in a row of its own: its cached prefix held in the cache, the rest shared
        (`SlotAllocator.share`). Parallel samples of one prompt read its KV from one copy, and
        each appends its own tokens after it."""
        cached = min(source.cached_len, length)
        shared = source.slots[cached:length]
        writes = []
        for req in forks:
            assert req.row is None and not req.slots, "a fork holds nothing of its own"
            self.kv_pool.allocator.share(shared)
            if source.cache_node is not None:
                assert self.prefix_cache is not None and cached == source.cached_len
                self.prefix_cache.lock(source.cache_node)
                req.cache_node, req.cached_len = source.cache_node, cached
            req.cached_tokens = source.cached_tokens
            req.row = self.req_to_token_pool.allocate_row()
            req.slots = source.slots[:length]
            writes.append((req.row, 0, req.slots))
        self.req_to_token_pool.write_many(writes)

    def release(self, req: Request, cache: bool = True) -> None:
        """Let go of `req`'s slots and row; its computed KV stays in the prefix cache unless
        `cache` is False (a failed forward may have left it wrong). Its copies of tokens the
        cache already held are freed."""
        own = req.slots[req.cached_len :]
        end = self._cacheable_end(req) if cache and req.row is not None else req.cached_len
        if end > req.cached_len:
            assert self.prefix_cache is not None
            present = self.prefix_cache.insert(req.token_ids(0, end), req.slots[:end])
            if self.companion is not None:
                self.companion.adopt(req, present, end)
            own = req.slots[req.cached_len : present] + req.slots[end:]
        if own:
            self.kv_pool.allocator.free(own)
        if req.cache_node is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.unlock(req.cache_node)
        if req.row is not None:
            self.req_to_token_pool.free_row(req.row)
        req.slots = []
        req.row = None
        req.kv_len = req.cached_len = 0
        req.cache_node = None

    def cached_slots(self) -> list[int]:
        """The slots the prefix cache holds (the KV audit counts them as held)."""
        return self.prefix_cache.slots() if self.prefix_cache is not None else []

    def prefix_cache_stats(self) -> dict:
        """The prefix cache's counters for a node's stats(); empty without one."""
        cache = self.prefix_cache
        if cache is None:
            return {}
        return {
            "prefix_cache_lookup_tokens": self.lookup_tokens,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_evicted_tokens": cache.evicted_tokens,
            "prefix_cache_tokens": cache.size,
        }

    def is_empty(self) -> bool:
        """No request holds a slot or a row (the prefix cache may hold slots of its own)."""
        allocator = self.kv_pool.allocator
        allocator.check_integrity()
        cached, held = 0, 0
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            cached = self.prefix_cache.size
            held = cached - self.prefix_cache.evictable_size
        rows_free = self.req_to_token_pool.num_free_rows == self.req_to_token_pool.max_reqs
        return allocator.num_used == cached and not held and rows_free
