"""`pdcluster serve`: launch the cluster, put the router behind the OpenAI-compatible HTTP API,
print the URL when ready, and stop every actor on exit (Ctrl-C included)."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from cluster.config import ServeConfig
from cluster.launcher import Cluster, describe_nodes
from cluster.openai_api import create_app

log = logging.getLogger(__name__)


def serve(config: ServeConfig) -> None:
    print(f"starting {describe_nodes(config.cluster)} ...", flush=True)
    cluster = Cluster.launch(config.cluster)
    try:
        asyncio.run(_serve_http(cluster, config))
    finally:
        print("stopping the cluster ...", flush=True)
        cluster.shutdown()


async def _serve_http(cluster: Cluster, config: ServeConfig) -> None:
    router = cluster.router
    if config.served_model_name:
        router.model_name = config.served_model_name
    await router.start()
    app = create_app(
        router,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
        metrics_require_api_key=config.metrics_require_api_key,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="warning")
    )
    announce = asyncio.create_task(_announce_when_ready(server, config))
    try:
        await server.serve()
    finally:
        announce.cancel()
        await router.close()


async def _announce_when_ready(server: uvicorn.Server, config: ServeConfig) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    print(
        f"pdcluster is serving {config.cluster.engine.model or 'the default model'} at "
        f"http://{host}:{config.port}/v1  (Ctrl-C stops it)",
        flush=True,
    )
