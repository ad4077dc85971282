"""The cache_aware prefill policy (cluster.control.cache_aware) and the router's tree of what it
sent each node (cluster.control.routed_prefixes): the longest cached prefix wins, a node too busy
beyond the threshold or a match too short gives way to the least-loaded node, a node's death or
replacement drops what the router believed it held, and each tree stays within its bound.
tests/test_prefix_cache_cluster.py runs the policy through a cluster of two prefill nodes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from cluster.control.cache_aware import CacheAware
from cluster.control.node_state import NodeState
from cluster.control.policies import PolicyOptions, create_policy
from cluster.control.routed_prefixes import RoutedPrefixes
from cluster.control.router import Router
from cluster.deploy.config import ClusterConfig
from metadata.control_auth import new_control_key


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_tree_matches_the_longest_prefix_of_what_it_was_given():
    rng = random.Random(0)
    tree = RoutedPrefixes(max_tokens=1_000_000)
    held: list[list[int]] = []
    for _ in range(300):
        # Small alphabet and shared starts: edges split at every depth.
        base = rng.choice(held) if held and rng.random() < 0.7 else []
        prompt = base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(8)]
        probe = prompt[: rng.randint(0, len(prompt))] + [rng.randrange(4) for _ in range(3)]
        assert tree.match(probe) == max((_common(probe, p) for p in held), default=0)
        tree.insert(prompt)
        held.append(prompt)
        tree.check_integrity()
    assert tree.size <= sum(len(p) for p in held)
    assert all(tree.match(p) == len(p) for p in held)


def test_the_tree_stays_within_its_bound_dropping_the_least_recently_used():
    tree = RoutedPrefixes(max_tokens=100)
    system = list(range(1000, 1030))
    prompts = [system + [i] * 20 for i in range(10)]
    for prompt in prompts:
        tree.insert(prompt)
        tree.check_integrity()
        assert tree.size <= 100
    # 30 shared tokens and three 20-token tails fit: the three newest prompts.
    assert [tree.match(p) == 50 for p in prompts] == [False] * 7 + [True] * 3
    tree.insert(prompts[7])  # used again: now the newest
    tree.insert(system + [99] * 20)
    assert tree.match(prompts[7]) == 50 and tree.match(prompts[8]) == 30
    # A prompt longer than the bound keeps its first max_tokens tokens.
    tree.insert(list(range(500)))
    tree.check_integrity()
    assert tree.size == 100 and tree.match(list(range(500))) == 100


def _nodes(*loads: int) -> list[NodeState]:
    nodes = [NodeState("prefill", i, None) for i in range(len(loads))]
    for node, load in zip(nodes, loads):
        node.reported(load)
    return nodes


def test_the_node_with_the_longest_prefix_wins():
    policy = CacheAware(tokens_per_node=10_000)
    nodes = _nodes(0, 0, 0)
    first, second = list(range(100)), list(range(500, 600))
    assert policy.pick(nodes, first) is nodes[0]
    # Nothing of it anywhere: the least-loaded node holding least, not node 0 again.
    assert policy.pick(nodes, second) is nodes[1]
    nodes[1].reported(3)  # busier, but within the threshold
    assert policy.pick(nodes, second + [7, 8]) is nodes[1]
    assert policy.pick(nodes, first + [9]) is nodes[0]
    # A longer match beats a shorter one: node 2 is given a longer prefix of `first`, and wins
    # over node 0, the least loaded (holding least), by what it saves.
    longer = first + list(range(1000, 1040))
    policy.trees[2] = RoutedPrefixes(10_000)
    policy.trees[2].insert(longer)
    assert policy.pick(nodes, longer + [1]) is nodes[2]


def test_a_node_busier_than_the_threshold_gives_way_to_the_least_loaded():
    policy = CacheAware(tokens_per_node=10_000, load_threshold=2)
    nodes = _nodes(0, 0)
    prompt = list(range(200))
    assert policy.pick(nodes, prompt) is nodes[0]
    nodes[0].reported(2)  # exactly the threshold more: still the cached node
    assert policy.pick(nodes, prompt + [1]) is nodes[0]
    nodes[0].reported(3)  # beyond it
    assert policy.pick(nodes, prompt + [2]) is nodes[1]
    # Node 1 now holds the longer prefix of the next one.
    assert policy.pick(nodes, prompt + [2, 3]) is nodes[1]


def test_a_prefix_counts_by_what_it_saves_over_the_least_loaded_node():
    policy = CacheAware(tokens_per_node=10_000, min_saved_share=0.25)
    nodes = _nodes(0, 0)
    template = [1, 2, 3, 4]
    assert policy.pick(nodes, template + list(range(100, 120))) is nodes[0]
    # Sharing the template's 4 tokens of 24 saves too little to load node 0 again.
    assert policy.pick(nodes, template + list(range(200, 220))) is nodes[1]
    # Both hold the template now: it saves nothing on either, the least loaded gets it.
    nodes[1].reported(1)
    assert policy.pick(nodes, template + list(range(300, 320))) is nodes[0]
    nodes[0].reported(2)
    assert policy.pick(nodes, template + list(range(400, 420))) is nodes[1]
    # 10 tokens on node 0 against the template on node 1 (the least loaded): a quarter saved.
    assert policy.pick(nodes, template + list(range(100, 106)) + [0] * 14) is nodes[0]
    assert policy.pick(nodes, template + list(range(100, 105)) + [0] * 15) is nodes[1]
    # Prompts given as vectors come with no ids: the least loaded, and nothing is recorded.
    sizes = {i: tree.size for i, tree in policy.trees.items()}
    assert policy.pick(nodes, []) is nodes[1]
    assert {i: tree.size for i, tree in policy.trees.items()} == sizes


def test_forgetting_a_node_drops_what_it_held():
    policy = CacheAware(tokens_per_node=10_000)
    nodes = _nodes(0, 0)
    prompt = list(range(300))
    assert policy.pick(nodes, prompt) is nodes[0]
    nodes[0].reported(1)
    assert policy.pick(nodes, prompt + [1]) is nodes[0]  # held there, though busier
    policy.forget(0)
    assert 0 not in policy.trees
    assert policy.pick(nodes, prompt + [2]) is nodes[1]  # held nowhere: the least loaded


def _router(prefill: int) -> Router:
    spec = SimpleNamespace(
        tokenizer=None,
        path=SimpleNamespace(name="model"),
        engine_config=SimpleNamespace(max_model_len=64, max_tokens_cap=None, max_num_seqs=8),
    )
    return Router(
        spec,
        [NodeState("prefill", i, None) for i in range(prefill)],
        [NodeState("decode", 0, None)],
        kv_cache_tokens=64,
        control_key=new_control_key(),
        prefill_policy="cache_aware",
        cache_aware_load_threshold=3,
        watch_health=False,
    )


def test_the_router_drops_a_dead_or_replaced_nodes_entries():
    router = _router(prefill=2)
    policy = router.prefill_policy
    assert isinstance(policy, CacheAware)
    assert (policy.load_threshold, policy.tokens_per_node) == (3, 64)
    prompt = list(range(40))
    first = router._pick(router.prefill_nodes, "prefill", prompt)
    assert router._pick(router.prefill_nodes, "prefill", prompt + [1]) is first
    router.node_down(first, "killed")
    assert first.index not in policy.trees
    other = router._pick(router.prefill_nodes, "prefill", prompt + [2])
    assert other is not first
    router.revive(first, "tcp://127.0.0.1:1", first.ping, None)
    # A new prompt goes to the node believed to hold least: the one just back.
    assert router._pick(router.prefill_nodes, "prefill", list(range(100, 140))) is first
    assert policy.trees[first.index].size == 40
    router.revive(first, "tcp://127.0.0.1:2", first.ping, None)  # replaced again
    assert first.index not in policy.trees


def test_cache_aware_is_a_prefill_and_a_decode_policy():
    assert isinstance(create_policy("cache_aware", PolicyOptions(128, 4)), CacheAware)
    ClusterConfig(prefill_policy="cache_aware", cache_aware_load_threshold=0)
    # Decode nodes hold finished conversations' KV (decode_node.reuse).
    ClusterConfig(decode_policy="cache_aware")
    with pytest.raises(ValueError, match="decode policy 'random'.*supported: cache_aware, least"):
        ClusterConfig(decode_policy="random")
    with pytest.raises(ValueError, match="supported: cache_aware, least_load, round_robin"):
        ClusterConfig(prefill_policy="random")
    with pytest.raises(ValueError, match="cache_aware_load_threshold"):
        ClusterConfig(cache_aware_load_threshold=-1)
    with pytest.raises(ValueError, match="tokens_per_node"):
        CacheAware(tokens_per_node=0)
