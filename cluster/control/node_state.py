"""The router's view of one node: how to probe it and read its stats, whether it is up, and
what the supervisor did with it (restarts, given up), and the cluster's health answer made of
those views. Shared by the router, the metrics and the supervisor."""

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
    # Add to the node's trace timestamps to get the router's
    # (cluster.control.tracing.clock_offset_ns).
    clock_offset_ns: int = 0
    # Why the node serves with a fault (a transfer stuck past its timeout), from its probe.
    degraded: str | None = None
    # How many times the node was replaced (cluster.control.supervisor), and whether it is being
    # replaced now or was given up on.
    restarts: int = 0
    restarting: bool = False
    given_up: bool = False
    # The requests the node holds, as it last reported them (NodeLoad), and those this front
    # end sent it since: its load as the routing policies see it.
    reported_requests: int | None = None
    routed_since_report: int = 0
    # The node's latest stats() as the controller relayed them (an API process of several).
    reported_stats: dict | None = None

    @property
    def load(self) -> int:
        """The node's requests as it reported them plus this front end's since; before its
        first report, this front end's requests in flight there."""
        if self.reported_requests is None:
            return self.in_flight
        return self.reported_requests + self.routed_since_report

    def reported(self, requests: int) -> None:
        self.reported_requests = requests
        self.routed_since_report = 0

    def forget_load(self) -> None:
        """A replacement starts from nothing: back to this front end's own count until it
        reports."""
        self.reported_requests = None
        self.routed_since_report = 0

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


def health_report(
    prefill_nodes: list[NodeState], decode_nodes: list[NodeState], aggregated: bool
) -> dict[str, Any]:
    """The cluster's health answer: each node's status, and "ok" when all are, "degraded" while
    a node of each role (a replica, when `aggregated`) is still alive, else "down"."""
    nodes = []
    for n in prefill_nodes + decode_nodes:
        error = n.degraded if n.alive else n.error
        nodes.append(
            {
                "name": n.name,
                "status": n.status,
                "in_flight": n.in_flight,
                "restarts": n.restarts,
                **({"error": error} if error else {}),
            }
        )
    alive_p = aggregated or any(n.alive for n in prefill_nodes)
    alive_d = any(n.alive for n in decode_nodes)
    all_alive = all(n["status"] == "ok" for n in nodes)
    status = "ok" if all_alive else ("degraded" if alive_p and alive_d else "down")
    return {"status": status, "nodes": nodes}
