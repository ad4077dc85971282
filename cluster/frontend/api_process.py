"""One of several API processes (`pdcluster serve --api-servers N`): an HTTP front end of its
own on the cluster's port, started by the controller (cluster.frontend.api_servers) with
`python -m cluster.frontend.api_process` and its `ApiProcessConfig` as one JSON line on stdin.

It tokenizes, routes and streams the requests it accepted, exactly as a lone front end does
(cluster.control.router, cluster.frontend.openai_api): the nodes stream each request's tokens to the
process that holds its connection. It does not probe the nodes: it follows the controller's
ClusterStatus (a node that died fails its requests here too; a replacement is introduced to at
its new endpoint), and takes the nodes' stats from it for /metrics. When the controller goes
away (its end of stdin closes), the process drains and exits."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

from cluster.control.node_state import NodeState
from cluster.deploy.config import ClusterConfig, ServeConfig
from engine.loading.loader import EngineArgs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiProcessConfig:
    """What an API process needs to know; plain data, so that it crosses a pipe as JSON."""

    index: int
    frontend_id: int
    controller: str  # the controller's inbox, where this process says hello
    inbox_host: str  # the address this process's inbox binds, which the nodes reach
    control_key: str  # the cluster's control-plane key, hex
    serve: ServeConfig
    kv_cache_tokens: int
    prefill_nodes: list[tuple[int, str]]  # (index, endpoint)
    decode_nodes: list[tuple[int, str]]  # the replicas on an aggregated cluster
    port: int  # the port every API process listens on (SO_REUSEPORT)
    metrics_dir: str
    trace_dir: str | None
    prune_trace_files: bool
    max_queued_requests: int | None  # this process's share of the limit

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ApiProcessConfig:
        raw = json.loads(text)
        serve = dict(raw["serve"])
        cluster = dict(serve.pop("cluster"))
        engine = dict(cluster.pop("engine"))
        layers = engine.get("debug_tensor_dump_layers")
        if layers is not None:
            engine["debug_tensor_dump_layers"] = tuple(layers)
        raw["serve"] = ServeConfig(
            cluster=ClusterConfig(engine=EngineArgs(**engine), **cluster), **serve
        )
        raw["prefill_nodes"] = [tuple(node) for node in raw["prefill_nodes"]]
        raw["decode_nodes"] = [tuple(node) for node in raw["decode_nodes"]]
        return cls(**raw)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port) beside the cluster's other API processes: the kernel
    spreads new connections over every socket listening there (SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _node_states(role: str, nodes: list[tuple[int, str]]) -> list[NodeState]:
    states = []
    for index, endpoint in nodes:
        state = NodeState(role, index, _no_probe, endpoint)
        state.stats = _relayed_stats(state)
        states.append(state)
    return states


async def _no_probe() -> None:
    """An API process of several never probes a node: the controller does."""


def _relayed_stats(node: NodeState):
    async def stats() -> dict[str, Any]:
        if node.reported_stats is None:
            raise RuntimeError("the controller has not relayed its stats yet")
        return node.reported_stats

    return stats


def _drain_when_controller_goes() -> None:
    """The controller holds this process's stdin open for its whole life: its end is the
    controller's (killed, or gone without a word)."""
    sys.stdin.read()
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    from cluster.commands.serve import event_loop_factory, run_api
    from cluster.control.router import Router
    from spec.compose import resolve_model

    config = ApiProcessConfig.from_json(sys.stdin.readline())
    serve = config.serve
    cluster = serve.cluster
    level = cluster.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s api-{config.index} %(message)s")
    # The controller gives the engine arguments as its own driver resolved them (the device
    # chosen, no KV pool to size: cluster.deploy.launcher.driver_engine_args).
    spec = resolve_model(cluster.engine)
    decode_role = "replica" if cluster.aggregated else "decode"
    router = Router(
        spec,
        _node_states("prefill", config.prefill_nodes),
        _node_states(decode_role, config.decode_nodes),
        kv_cache_tokens=config.kv_cache_tokens,
        control_key=bytes.fromhex(config.control_key),
        prefill_policy=cluster.prefill_policy,
        decode_policy=cluster.decode_policy,
        cache_aware_load_threshold=cluster.cache_aware_load_threshold,
        host=config.inbox_host,
        tracing=cluster.enable_tracing,
        trace_dir=config.trace_dir,
        frontend_id=config.frontend_id,
        watch_health=False,
        controller=config.controller,
        multiprocess_dir=config.metrics_dir,
        prune_trace_files=config.prune_trace_files,
    )
    if serve.served_model_name:
        router.model_name = serve.served_model_name
    sock = listening_socket(serve.host, config.port)
    threading.Thread(target=_drain_when_controller_goes, daemon=True).start()
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(
            run_api(
                router,
                serve,
                sock=sock,
                max_queued_requests=config.max_queued_requests,
                api_server=config.index,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
