"""The router's view of one node: how to probe it and read its stats, whether it is up, and
what the supervisor did with it (restarts, given up). Shared by the router, the metrics and
the supervisor."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class NodeState:
    """The router's view of one node; `ping` is an awaitable health probe and `stats` an
    awaitable of the node's stats() for /metrics (Ray calls)."""

    role: str
    index: int
    ping: Callable[[], Awaitable[Any]]
    endpoint: str | None = None
    alive: bool = True
    in_flight: int = 0
    error: str | None = None
    stats: Callable[[], Awaitable[dict]] | None = None
    # Add to the node's trace timestamps to get the router's (cluster.tracing.clock_offset_ns).
    clock_offset_ns: int = 0
    # Why the node serves with a fault (a transfer stuck past its timeout), from its probe.
    degraded: str | None = None
    # How many times the node was replaced (cluster.supervisor), and whether it is being
    # replaced now or was given up on.
    restarts: int = 0
    restarting: bool = False
    given_up: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def status(self) -> str:
        if self.alive:
            return "degraded" if self.degraded else "ok"
        if self.given_up:
            return "failed"
        return "restarting" if self.restarting else "down"
