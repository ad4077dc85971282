"""The prefix cache's radix tree (engine.scheduling.prefix_cache) and its bookkeeping with requests
(engine.scheduling.kv_cache.KVCacheManager): longest-prefix matches, split edges,
least-recently-used eviction of nodes without holds only, reference counts, and the invariants of
the interface's docstring (check_integrity) after every operation of a random workload."""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.kv_cache import EVICT_AT_LEAST, KVCacheManager
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from engine.scheduling.prefix_cache import PrefixCache


def _slots(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_match_finds_the_longest_cached_prefix():
    cache = PrefixCache()
    assert cache.insert([1, 2, 3, 4], _slots(10, 4)) == 0
    assert cache.insert([5, 6], _slots(20, 2)) == 0
    assert cache.match([1, 2, 3, 4, 9]).slots == [10, 11, 12, 13]
    assert cache.match([1, 2, 3]).slots == [10, 11, 12]
    assert cache.match([5, 7]).slots == [20]
    miss = cache.match([8, 1, 2])
    assert miss.length == 0 and miss.node is cache.root
    assert cache.size == 6 and cache.evictable_size == 6
    cache.check_integrity()


def test_a_match_inside_an_edge_splits_it_and_insert_keeps_what_is_cached():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], _slots(10, 4))
    match = cache.match([1, 2, 9])
    assert match.slots == [10, 11]
    # The match ends at a node of its own: the edge [1, 2, 3, 4] is now [1, 2] -> [3, 4].
    assert match.node.key == [1, 2] and list(match.node.children) == [3]
    assert match.node.children[3].key == [3, 4] and match.node.children[3].slots == [12, 13]
    # Tokens already cached keep their slots: only the new tail's slots join the tree.
    assert cache.insert([1, 2, 5, 6], [30, 31, 32, 33]) == 2
    assert cache.match([1, 2, 5, 6]).slots == [10, 11, 32, 33]
    assert cache.insert([1, 2, 3], [40, 41, 42]) == 3
    assert cache.size == 6
    cache.check_integrity()


def test_eviction_takes_the_least_recently_used_leaves_first():
    cache = PrefixCache()
    cache.insert([1, 1], _slots(10, 2))
    cache.insert([2, 2], _slots(20, 2))
    cache.insert([3, 3], _slots(30, 2))
    cache.match([1, 1])  # [1, 1] is now the most recently used
    assert cache.evict(1) == [20, 21]
    assert cache.evict(2) == [30, 31]
    assert cache.evict(5) == [10, 11]
    assert cache.size == 0 and cache.evicted_tokens == 6
    cache.check_integrity()


def test_a_parent_goes_only_after_its_children():
    cache = PrefixCache()
    cache.insert([1, 2, 3], _slots(10, 3))
    cache.insert([1, 2, 4], [20, 21, 22])  # splits [1, 2 | 3], adds [4]
    cache.match([1, 2])  # the shared parent is the most recently used, yet it goes last
    assert sorted(cache.evict(1)) in ([12], [22])
    freed = cache.evict(2)
    assert freed[-2:] == [10, 11] and cache.size == 0


def test_held_prefixes_are_never_evicted_until_released():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], _slots(10, 4))
    cache.insert([7, 8], _slots(20, 2))
    held = cache.match([1, 2, 3])
    cache.lock(held.node)
    # The held path [1, 2, 3] and its ancestors are kept; [4] below it and [7, 8] are free.
    assert cache.evictable_size == 3
    assert sorted(cache.evict(100)) == [13, 20, 21]
    assert cache.match([1, 2, 3, 4]).slots == [10, 11, 12]
    cache.lock(held.node)
    cache.unlock(held.node)
    assert cache.evict(100) == [] and cache.evictable_size == 0
    cache.unlock(held.node)
    assert cache.evictable_size == 3
    assert sorted(cache.evict(100)) == [10, 11, 12]
    with pytest.raises(ValueError, match="unlocked more often"):
        cache.unlock(held.node)


def test_holds_pass_through_a_split():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], _slots(10, 4))
    whole = cache.match([1, 2, 3, 4])
    cache.lock(whole.node)
    head = cache.match([1, 2]).node  # splits the held edge
    assert head.refs == 1 and cache.evict(10) == []
    cache.unlock(whole.node)
    assert head.refs == 0 and cache.evictable_size == 4
    cache.check_integrity()


def test_check_integrity_finds_a_corrupt_tree():
    cache = PrefixCache()
    cache.insert([1, 2], [10, 11])
    cache.insert([3], [11])  # the same slot twice
    with pytest.raises(AssertionError, match="held twice"):
        cache.check_integrity()
    cache = PrefixCache()
    cache.insert([1, 2], [10, 11])
    cache.root.children[1].refs = 1  # a hold the evictable count does not know of
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_integrity()


def test_random_workload_keeps_the_invariants():
    """Inserts, matches, holds and evictions at random against a plain dict of what was
    cached: every match returns the slots last cached for those tokens, and no held token is
    ever evicted."""
    rng = random.Random(0)
    cache = PrefixCache()
    next_slot = 1
    held: list[tuple[object, list[int]]] = []
    for _ in range(400):
        op = rng.random()
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
        if op < 0.4:
            present = cache.match(tokens).length
            slots = cache.match(tokens).slots + _slots(next_slot, len(tokens) - present)
            next_slot += len(tokens)
            assert cache.insert(tokens, slots) == present
        elif op < 0.6:
            match = cache.match(tokens)
            cache.lock(match.node)
            held.append((match.node, match.slots))
        elif op < 0.75 and held:
            node, _ = held.pop(rng.randrange(len(held)))
            cache.unlock(node)  # type: ignore[arg-type]
        else:
            freed = set(cache.evict(rng.randint(1, 6)))
            for _, slots in held:
                assert not freed & set(slots), "a held prefix was evicted"
        cache.check_integrity()
        for node, _ in held:
            assert node.refs > 0  # type: ignore[attr-defined]
    for node, _ in held:
        cache.unlock(node)  # type: ignore[arg-type]
    cache.evict(cache.size)
    assert cache.size == 0 and cache.evictable_size == 0


# --- with requests: engine.scheduling.kv_cache.KVCacheManager ---


def _manager(capacity: int, rows: int = 8) -> KVCacheManager:
    pool = KVPool(capacity, 1, 1, 2, torch.float32, "cpu")
    return KVCacheManager(pool, ReqToTokenPool(rows, 64, "cpu"), prefix_cache=PrefixCache())


def _request(tokens: list[int], name: str = "r") -> Request:
    return Request(name, tokens, SamplingParams(max_tokens=4))


def _prefill(manager: KVCacheManager, req: Request) -> None:
    """What the scheduler does for a prompt: start at its cached prefix, take slots for the
    rest, and (the forward having run) count the prompt as computed."""
    manager.match_prefix(req)
    manager.grow(req, req.num_tokens - req.kv_len)
    req.kv_len = req.num_tokens
    manager.cache_prefix(req)


def _row(manager: KVCacheManager, req: Request) -> list[int]:
    assert req.row is not None
    return manager.req_to_token_pool.req_to_token[req.row, : len(req.slots)].tolist()


def test_a_request_reads_a_cached_prefix_and_the_row_agrees():
    manager = _manager(32)
    first = _request([5, 6, 7, 8, 9])
    _prefill(manager, first)
    manager.release(first)
    assert manager.prefix_cache.size == 5 and manager.kv_pool.allocator.num_used == 5
    second = _request([5, 6, 7, 1, 2])
    _prefill(manager, second)
    assert second.cached_tokens == 3 and second.slots[:3] == first_slots(manager, [5, 6, 7])
    assert _row(manager, second) == second.slots
    # A whole prompt cached still computes its last token (its logits are needed).
    third = _request([5, 6, 7, 8, 9])
    manager.match_prefix(third)
    assert third.kv_len == 4
    assert third.cached_tokens == 4
    manager.unmatch(third)
    # Not admitted: it reports no cached prompt tokens it never used.
    assert third.slots == [] and third.cache_node is None and third.cached_tokens == 0
    assert manager.hit_tokens == 3 and manager.lookup_tokens == 8
    manager.release(second)
    assert manager.is_empty()


def first_slots(manager: KVCacheManager, tokens: list[int]) -> list[int]:
    return manager.prefix_cache.match(tokens).slots


def test_a_prompt_computed_twice_at_once_keeps_one_copy_once_let_go():
    """Two requests with the same prompt prefilled in one step: the second to reach the
    cache keeps reading its own slots (a transfer may be reading them) and frees them when it
    lets go, the cache keeping the first's."""
    manager = _manager(32)
    a, b = _request([1, 2, 3, 4, 5], "a"), _request([1, 2, 3, 4, 6], "b")
    for req in (a, b):
        manager.match_prefix(req)
    manager.grow_many([(a, 5), (b, 5)])
    a.kv_len = b.kv_len = 5
    b_slots = list(b.slots)
    manager.cache_prefix(a)
    manager.cache_prefix(b)
    assert a.cached_len == 5 and b.cached_len == 0 and b.slots == b_slots
    assert _row(manager, b) == b_slots and manager.kv_pool.allocator.num_used == 10
    manager.release(b)
    # Its tokens 1..4 were cached already: only its last token's slot joins the cache.
    assert manager.kv_pool.allocator.num_used == 6
    assert first_slots(manager, [1, 2, 3, 4, 6]) == a.slots[:4] + b_slots[4:]
    manager.release(a)
    assert manager.is_empty() and manager.prefix_cache.size == 6


def test_eviction_under_a_full_pool_frees_only_unreferenced_entries():
    manager = _manager(12)
    held = _request([1, 2, 3, 4, 5, 6], "held")
    _prefill(manager, held)  # 6 slots, held by a running request
    done = _request([7, 8, 9, 10], "done")
    _prefill(manager, done)
    manager.release(done)  # 4 cached slots nobody holds
    allocator = manager.kv_pool.allocator
    assert allocator.num_free == 2 and manager.prefix_cache.evictable_size == 4
    assert manager.can_grow(6) and not manager.can_grow(7)
    newcomer = _request([11, 12, 13, 14, 15], "new")
    manager.match_prefix(newcomer)
    manager.grow(newcomer, 5)
    # [7..10] went; the running request's prefix is still cached, its slots untouched.
    assert manager.prefix_cache.evicted_tokens == 4
    assert first_slots(manager, [1, 2, 3, 4, 5, 6]) == held.slots
    assert first_slots(manager, [7]) == []
    allocator.check_integrity()
    manager.prefix_cache.check_integrity()


def test_an_eviction_frees_a_batch_of_slots_not_just_what_one_step_lacks():
    """Each eviction walks the tree: with the pool full of cache, one per decode step would
    walk it at every step. It frees EVICT_AT_LEAST slots (the least recently used) at once."""
    capacity = 2 * EVICT_AT_LEAST
    manager = _manager(capacity, rows=capacity)
    for i in range(capacity // 8):  # the whole pool cached, in prompts of 8 nobody holds
        req = _request([1000 + 8 * i + j for j in range(8)], f"r{i}")
        _prefill(manager, req)
        manager.release(req)
    assert manager.kv_pool.allocator.num_free == 0
    manager.grow(_request([1, 2], "new"), 2)
    assert manager.prefix_cache.evicted_tokens == EVICT_AT_LEAST
    assert manager.kv_pool.allocator.num_free == EVICT_AT_LEAST - 2
    # The least recently used went: the first prompts, the latest still cached.
    assert first_slots(manager, [1000]) == []
    assert len(first_slots(manager, [1000 + capacity - 8 + j for j in range(8)])) == 8


def test_release_lets_go_of_the_prefix_and_caches_only_computed_kv():
    manager = _manager(32)
    _prefill(manager, req := _request([1, 2, 3, 4, 5]))
    manager.release(req)
    reader = _request([1, 2, 3, 4, 5, 6, 7])
    manager.match_prefix(reader)
    manager.grow(reader, 2)
    reader.kv_len = 6  # token 7's KV is not computed: it must not be cached
    assert manager.prefix_cache.evictable_size == 0
    manager.release(reader)
    assert manager.prefix_cache.evictable_size == manager.prefix_cache.size == 6
    assert manager.is_empty()
    # A failed request's KV is not cached.
    failed = _request([9, 9, 9])
    _prefill(manager, failed)  # caches at prefill; a failure after it caches nothing more
    failed.output_token_ids.append(4)
    failed.kv_len = 4
    manager.grow(failed, 1)
    manager.release(failed, cache=False)
    assert first_slots(manager, [9, 9, 9, 4]) == first_slots(manager, [9, 9, 9])
    assert manager.is_empty()


def test_parallel_samples_share_the_prompt_and_the_cache_takes_it_from_the_last():
    """Forks hold the source's cached prefix through the cache and its own slots through
    SlotAllocator.share; the shared slots join the cache only when one holder is left."""
    manager = _manager(32)
    _prefill(manager, first := _request([1, 2, 3]))
    manager.release(first)
    source = _request([1, 2, 3, 4, 5], "source")
    forks = [_request([1, 2, 3, 4, 5], f"fork{i}") for i in range(2)]
    manager.match_prefix(source)
    manager.grow(source, 2)
    manager.fork(source, forks, 5)
    source.kv_len = 5
    manager.cache_prefix(source)
    assert source.cached_len == 3  # tokens 4 and 5 are shared with the forks: not cached
    for fork in forks:
        assert fork.slots == source.slots and fork.cached_len == 3
    manager.release(source)
    manager.release(forks[0])
    assert manager.prefix_cache.size == 3
    forks[1].kv_len = 5
    manager.release(forks[1])  # the last holder: the prompt joins the cache
    assert manager.prefix_cache.size == 5 and manager.is_empty()
