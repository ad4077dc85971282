"""The router's watch over its nodes: each alive node is probed every HEALTH_INTERVAL_S; one
whose probe fails is down (Router.node_down), and what a probe reports (a fault it serves with,
channels to peers it found broken) reaches the router and the supervisor."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from metadata.serving_node import NodeHealth

if TYPE_CHECKING:
    from cluster.control.node_state import NodeState
    from cluster.control.router import Router

HEALTH_INTERVAL_S = 1.0


async def watch_health(router: Router) -> None:
    while True:
        await asyncio.sleep(HEALTH_INTERVAL_S)
        for node in router.prefill_nodes + router.decode_nodes:
            if node.alive:
                await probe(router, node)


async def probe(router: Router, node: NodeState) -> None:
    ping = node.ping
    try:
        health = await asyncio.wait_for(ping(), timeout=10 * HEALTH_INTERVAL_S)
    except Exception as err:  # noqa: BLE001 - any failed probe means the node is gone
        if node.ping is ping:  # not replaced meanwhile
            router.node_down(node, f"{type(err).__name__}: {err}")
        return
    if isinstance(health, NodeHealth) and node.ping is ping:
        if node.degraded != health.degraded:
            node.degraded = health.degraded
            router.nodes_changed()
        if health.broken_peers and router.on_channels_broken is not None:
            router.on_channels_broken(node, health.broken_peers)
