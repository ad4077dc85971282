"""The nodes' state as the cluster's controller tells it to its API processes (ClusterStatus,
cluster.frontend.api_servers): made from the controller's router, followed by each API process's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from metadata.messages import ClusterStatus, NodeStatus

if TYPE_CHECKING:
    from cluster.control.router import Router


def cluster_status(router: Router) -> ClusterStatus:
    """The nodes as `router` (the controller's) sees them, with their latest stats."""
    return ClusterStatus(
        [
            NodeStatus(
                node.role,
                node.index,
                node.endpoint or "",
                node.alive,
                node.error,
                node.degraded,
                node.restarts,
                node.restarting,
                node.given_up,
                node.clock_offset_ns,
                router.metrics.nodes.latest(node.name),
            )
            for node in router.prefill_nodes + router.decode_nodes
        ]
    )


def follow_status(router: Router, status: ClusterStatus) -> None:
    """Bring `router` (an API process's) to what the controller saw: a node it found dead fails
    the requests that need it, a replacement is introduced to at its endpoint, and the rest is
    copied."""
    nodes = {(n.role, n.index): n for n in router.prefill_nodes + router.decode_nodes}
    for seen in status.nodes:
        node = nodes.get((seen.role, seen.index))
        if node is None:
            continue
        if node.alive and not seen.alive:
            router.node_down(node, seen.error or "its probe failed")
        elif seen.alive and (not node.alive or seen.endpoint != node.endpoint):
            router.revive(node, seen.endpoint, node.ping, node.stats)
        node.error, node.degraded = seen.error, seen.degraded
        node.restarts, node.restarting, node.given_up = (
            seen.restarts,
            seen.restarting,
            seen.given_up,
        )
        node.clock_offset_ns = seen.clock_offset_ns
        node.reported_stats = seen.stats
    if status.api_servers:
        router.api_servers = [vars(server) for server in status.api_servers]
