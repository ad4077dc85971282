"""How the router picks a node for a request, chosen by name through a registry."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cluster.control.cache_aware import DEFAULT_LOAD_THRESHOLD, CacheAware


class NodeView(Protocol):
    index: int
    alive: bool

    @property
    def load(self) -> int: ...


class Policy(Protocol):
    def pick(self, nodes: Sequence[NodeView], prompt_token_ids: Sequence[int]) -> NodeView:
        """One of `nodes` (alive, not empty) for a request of `prompt_token_ids` (empty where
        the prompt is given as vectors)."""
        ...

    def forget(self, index: int) -> None:
        """Node `index` died or was replaced: whatever the policy kept about it is stale."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, nodes: Sequence[NodeView], prompt_token_ids: Sequence[int]) -> NodeView:
        return nodes[next(self._counter) % len(nodes)]

    def forget(self, index: int) -> None:
        pass


class LeastLoad:
    """The node with the least load (the requests it holds, as it reports them, and those sent
    to it since: cluster.control.node_state); ties go to the lowest index."""

    def pick(self, nodes: Sequence[NodeView], prompt_token_ids: Sequence[int]) -> NodeView:
        return min(nodes, key=lambda n: (n.load, n.index))

    def forget(self, index: int) -> None:
        pass


@dataclass(frozen=True)
class PolicyOptions:
    """What the policies that need more than a name are built with: `tokens_per_node`, the KV
    capacity of a node in tokens (cache_aware's bound on what it believes a node holds), and
    `load_threshold` (cache_aware's)."""

    tokens_per_node: int
    load_threshold: int = DEFAULT_LOAD_THRESHOLD


POLICIES: dict[str, Callable[[PolicyOptions], Policy]] = {
    "round_robin": lambda _: RoundRobin(),
    "least_load": lambda _: LeastLoad(),
    "cache_aware": lambda options: CacheAware(options.tokens_per_node, options.load_threshold),
}
# A decode node keeps its finished requests' KV (decode_node.reuse): cache_aware sends a
# conversation's next turn back to it, which then receives only the new tokens' KV.
DECODE_POLICIES = ("cache_aware", "least_load", "round_robin")


def create_policy(name: str, options: PolicyOptions) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; supported: {', '.join(sorted(POLICIES))}")
    return POLICIES[name](options)
