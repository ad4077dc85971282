"""Which prefill rank sends which KV heads to which decode rank (engine/tensor_parallel/
kv_routes.py), for every pairing of sizes that hold the KV heads: each decode rank gets exactly
its heads, each once, from a prefill rank that holds them; route (0, 0) comes first; nodes of
one layout pair rank i with rank i; a head replicated on several prefill ranks is sent by one
of them per decode rank; the rule of head placement is the engine's own."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from engine.tensor_parallel.kv_routes import KVHeads, KVRoute, kv_routes
from engine.tensor_parallel.layout import TensorParallelLayout

SIZES = [1, 2, 4, 8]
HEADS = [1, 2, 4, 8]


def _held(heads: KVHeads, rank: int) -> set[int]:
    return set(range(heads.first(rank), heads.first(rank) + heads.local))


@pytest.mark.parametrize("kv, a, b", list(itertools.product(HEADS, SIZES, SIZES)))
def test_each_decode_rank_gets_exactly_its_heads_from_holders(kv: int, a: int, b: int) -> None:
    prefill, decode = KVHeads(a, kv), KVHeads(b, kv)
    routes = kv_routes(kv, a, b)
    assert routes[0].on_node_channel and routes[0].first_head == 0
    got: dict[int, Counter] = {d: Counter() for d in range(b)}
    for route in routes:
        heads = range(route.first_head, route.first_head + route.num_heads)
        assert set(heads) <= _held(prefill, route.prefill_rank)
        got[route.decode_rank].update(heads)
    for d in range(b):
        assert got[d] == Counter(_held(decode, d)), d


@pytest.mark.parametrize("kv, size", list(itertools.product(HEADS, SIZES)))
def test_one_layout_pairs_rank_i_with_rank_i(kv: int, size: int) -> None:
    routes = kv_routes(kv, size, size)
    assert [(r.prefill_rank, r.decode_rank) for r in routes] == [(i, i) for i in range(size)]


def test_replicated_heads_are_sent_once_per_decode_rank() -> None:
    """Two KV heads: 4 prefill ranks hold each twice; a decode node of 2 takes head 1 from one
    of its two holders only, and ranks 1 and 2 send nothing."""
    assert kv_routes(2, 4, 2) == (KVRoute(0, 0, 0, 1), KVRoute(3, 1, 1, 1))
    # A decode node of 4 replicates too: each of a head's holders serves one of its replicas.
    assert kv_routes(2, 2, 4) == (
        KVRoute(0, 0, 0, 1),
        KVRoute(0, 1, 0, 1),
        KVRoute(1, 2, 1, 1),
        KVRoute(1, 3, 1, 1),
    )
    # One decode rank takes both heads, from the two prefill ranks that split them.
    assert kv_routes(2, 2, 1) == (KVRoute(0, 0, 0, 1), KVRoute(1, 0, 1, 1))


# (KV heads, ranks): each rank's first KV head, and how many it holds. Fewer heads than ranks:
# each head on consecutive ranks; more: consecutive heads on each rank.
PLACEMENTS = {
    (1, 1): ([0], 1),
    (1, 4): ([0, 0, 0, 0], 1),
    (2, 1): ([0], 2),
    (2, 2): ([0, 1], 1),
    (2, 4): ([0, 0, 1, 1], 1),
    (2, 8): ([0, 0, 0, 0, 1, 1, 1, 1], 1),
    (4, 2): ([0, 2], 2),
    (4, 8): ([0, 0, 1, 1, 2, 2, 3, 3], 1),
    (8, 2): ([0, 4], 4),
    (8, 4): ([0, 2, 4, 6], 2),
    (8, 8): (list(range(8)), 1),
}


@pytest.mark.parametrize("kv, size", list(PLACEMENTS))
def test_placement_is_the_engines(kv: int, size: int) -> None:
    """The routes' placement and the engine's layout both give the expected table."""
    firsts, local = PLACEMENTS[(kv, size)]
    layout = TensorParallelLayout(size, 8 * size, kv, 16, 64 * size, 100)
    heads = KVHeads(size, kv)
    assert [heads.first(rank) for rank in range(size)] == firsts
    assert [layout.first_kv_head(rank) for rank in range(size)] == firsts
    assert heads.local == layout.local_kv_heads == local


def test_sizes_that_cannot_hold_the_heads_say_why() -> None:
    assert KVHeads(2, 2).splits() is None and KVHeads(4, 2).splits() is None
    assert (
        KVHeads(3, 2).splits() == "tp_size 3 neither divides num_kv_heads 2 nor is a multiple of it"
    )
    assert KVHeads(2, 3).splits() is not None
