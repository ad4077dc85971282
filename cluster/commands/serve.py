"""`pdcluster serve`: launch the cluster, put the router behind the OpenAI-compatible HTTP API,
print the URL when ready, and stop every actor on exit.

With `--api-servers N` above 1 this process is the cluster's controller only (Ray, the nodes'
health and replacement), and N API processes serve the port (cluster.frontend.api_servers).

SIGTERM or a first Ctrl-C drains (cluster.frontend.admission): new requests are refused with a 503
and /health answers 503, the requests in flight get up to the drain timeout to finish, then the HTTP
server and the cluster stop and the process exits 0. A second signal stops at once (exit 130).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import replace

from cluster.deploy.config import ServeConfig, default_api_servers
from cluster.deploy.launcher import Cluster, describe_nodes
from cluster.frontend.api_server import event_loop_factory, run_api
from cluster.frontend.api_servers import ApiServers
from engine.cpu_tuning import freeze_startup_heap

log = logging.getLogger(__name__)


def serve(config: ServeConfig) -> int:
    """Serve until stopped; the exit status: 0 after a drain, 130 when stopped at once."""
    print(f"starting {describe_nodes(config.cluster)} ...", flush=True)
    cluster = Cluster.launch(config.cluster)
    if config.api_servers is None:
        config = replace(config, api_servers=default_api_servers(cluster.spec.engine_config.device))
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            if config.api_servers > 1:
                return runner.run(serve_api_processes(cluster, config))
            router = cluster.router
            if config.served_model_name:
                router.model_name = config.served_model_name
            return runner.run(
                run_api(router, config, on_ready=lambda: _announce(config, config.port))
            )
    finally:
        print("stopping the cluster ...", flush=True)
        cluster.shutdown()


def _announce(config: ServeConfig, port: int) -> None:
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    servers = f" by {config.api_servers} API processes" if config.api_servers > 1 else ""
    print(
        f"pdcluster is serving {config.cluster.engine.model or 'the default model'} at "
        f"http://{host}:{port}/v1{servers}  (Ctrl-C or SIGTERM drains and stops it)",
        flush=True,
    )


async def serve_api_processes(cluster: Cluster, config: ServeConfig) -> int:
    """The controller of `config.api_servers` API processes: it probes the nodes (its router
    serves no HTTP), tells the API processes what it finds, restarts one that dies, and on a
    signal drains them all (a second signal stops them at once)."""
    router = cluster.router
    await router.start()
    freeze_startup_heap()
    servers = ApiServers(cluster, config)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        await servers.start()
        _announce(config, servers.port)
        for sig in signals:
            loop.add_signal_handler(sig, servers.signalled, signal.Signals(sig).name)
        return await servers.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await servers.stop()
        await router.close()
