"""How the router picks a node for a request, chosen by name through a registry."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol


class NodeView(Protocol):
    index: int
    alive: bool

    @property
    def load(self) -> int: ...


class Policy(Protocol):
    def pick(self, nodes: Sequence[NodeView]) -> NodeView: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, nodes: Sequence[NodeView]) -> NodeView:
        return nodes[next(self._counter) % len(nodes)]


class LeastLoad:
    """The node with the least load (the requests it holds, as it reports them, and those sent
    to it since: cluster.node_state); ties go to the lowest index."""

    def pick(self, nodes: Sequence[NodeView]) -> NodeView:
        return min(nodes, key=lambda n: (n.load, n.index))


POLICIES: dict[str, Callable[[], Policy]] = {"round_robin": RoundRobin, "least_load": LeastLoad}


def create_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; supported: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
