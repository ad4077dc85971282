"""The `cache_aware` prefill policy: send a prompt to the prefill node that holds the longest
prefix of it in its prefix cache, unless that node is busier than the least-loaded node by more
than a threshold, or holds too little more of the prompt than the least-loaded node does.

How the router knows what a node holds: it keeps, per node, an approximate radix tree of the
prompts it sent there (cluster.control.routed_prefixes, SGLang's model gateway does the same), not
the nodes' own KV events (stored / evicted, as vLLM and llm-d use). The tree needs no new message
and no per-token traffic from nodes, and for what routing needs, a conversation's next turn
going back to the node that computed its last, it is exact: a prompt's KV is cached on the
node that prefilled it. Where it is not: a node that evicted a prompt still looks like it holds
it until the tree's own bound (a node's KV capacity in tokens, as the router knows it) drops
it, and a router learns only of the prompts it routed itself, so the API processes of a front
end with several each keep their own tree. A node that dies or is replaced starts with an
empty cache, and so does its tree (`forget`).
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.control.routed_prefixes import RoutedPrefixes

# How many requests more than the least-loaded node a node holding the prefix may hold and
# still get the prompt; past it the longer queue is taken to cost more than the prefix saves.
# A judgement, not a measurement: --cache-aware-load-threshold tunes it.
DEFAULT_LOAD_THRESHOLD = 8
# A prefix must save at least this share of the prompt's prefill over the least-loaded node
# to be worth a longer queue: prompts share short openings by chance (a chat template, "User:")
# that would otherwise draw traffic to one node. A conversation's second turn, whose history
# holds the first answer that no prefill node computed, finds from a tenth to a half of
# itself cached (the built-in conversations of `pdcluster bench serving`).
DEFAULT_MIN_SAVED_SHARE = 0.1


class CacheAware:
    """Picks, among the alive `nodes` it is given (cluster.control.policies.NodeView), the node
    whose tree holds the longest prefix of the prompt (ties: the least loaded, then the lowest
    index), where that prefix is longer than what the least-loaded node holds by at least
    `min_saved_share` of the prompt and the node's load exceeds the least-loaded node's by at most
    `load_threshold` requests; else the least-loaded node (ties: the one whose tree holds least,
    then the lowest index), which spreads new prompts over the nodes. The node picked is told the
    prompt (its tree holds it)."""

    def __init__(
        self,
        tokens_per_node: int,
        load_threshold: int = DEFAULT_LOAD_THRESHOLD,
        min_saved_share: float = DEFAULT_MIN_SAVED_SHARE,
    ) -> None:
        if tokens_per_node < 1:
            raise ValueError(f"tokens_per_node must be at least 1, got {tokens_per_node}")
        if load_threshold < 0:
            raise ValueError(f"load_threshold must be >= 0, got {load_threshold}")
        if not 0 <= min_saved_share <= 1:
            raise ValueError(f"min_saved_share must be in [0, 1], got {min_saved_share}")
        self.tokens_per_node = tokens_per_node
        self.load_threshold = load_threshold
        self.min_saved_share = min_saved_share
        self.trees: dict[int, RoutedPrefixes] = {}

    def _tree(self, index: int) -> RoutedPrefixes:
        tree = self.trees.get(index)
        if tree is None:
            tree = self.trees[index] = RoutedPrefixes(self.tokens_per_node)
        return tree

    def pick(self, nodes: Sequence, prompt_token_ids: Sequence[int]):
        matched = {node.index: self._tree(node.index).match(prompt_token_ids) for node in nodes}
        least = min(nodes, key=lambda n: (n.load, self._tree(n.index).size, n.index))
        best = min(nodes, key=lambda n: (-matched[n.index], n.load, n.index))
        saved = matched[best.index] - matched[least.index]
        worth = saved > 0 and saved >= self.min_saved_share * len(prompt_token_ids)
        chosen = best if worth and best.load - least.load <= self.load_threshold else least
        self._tree(chosen.index).insert(prompt_token_ids)
        return chosen

    def forget(self, index: int) -> None:
        """Node `index` died or was replaced: nothing of what it held is left."""
        self.trees.pop(index, None)
