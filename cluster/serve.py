"""`pdcluster serve`: launch the cluster, put the router behind the OpenAI-compatible HTTP API,
print the URL when ready, and stop every actor on exit.

SIGTERM or a first Ctrl-C drains (cluster.admission): new requests are refused with a 503 and
/health answers 503, the requests in flight get up to the drain timeout to finish, then the HTTP
server and the cluster stop and the process exits 0. A second signal stops at once (exit 130).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from cluster.admission import Admission
from cluster.config import ServeConfig
from cluster.launcher import Cluster, describe_nodes
from cluster.openai_api import create_app
from engine.cpu_tuning import freeze_startup_heap

log = logging.getLogger(__name__)

# After the drain, how long the HTTP server waits for connections still open (a slow client
# reading its last bytes) before closing them.
SHUTDOWN_GRACE_S = 5.0
STOPPED_AT_ONCE_STATUS = 128 + signal.SIGINT


def event_loop_factory():
    """uvloop's event loop where it is installed (a faster loop for the many small reads and
    writes of streaming), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(config: ServeConfig) -> int:
    """Serve until stopped; the exit status: 0 after a drain, 130 when stopped at once."""
    print(f"starting {describe_nodes(config.cluster)} ...", flush=True)
    cluster = Cluster.launch(config.cluster)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(_serve_http(cluster, config))
    finally:
        print("stopping the cluster ...", flush=True)
        cluster.shutdown()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM or SIGINT drains before it stops, and
    a second one stops it at once."""

    def __init__(
        self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._signalled = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            if self._drain is not None:
                self._drain.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's signal handler; not calling the base keeps uvicorn from raising the signal
        # again once it has stopped, which would make a drained exit a killed one.
        if self._signalled or self._loop is None:
            self.should_exit = True
            self.force_exit = True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)

    def _begin_drain(self, signal_name: str) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit(signal_name))

    async def _drain_then_exit(self, signal_name: str) -> None:
        print(
            f"{signal_name}: draining: refusing new requests, waiting up to "
            f"{self.drain_timeout_s:g} s for {self.admission.in_flight} in flight "
            f"(Ctrl-C again stops at once) ...",
            flush=True,
        )
        ended = await self.admission.drain(self.drain_timeout_s)
        if ended:
            print(f"the drain timeout ended {ended} unfinished requests", flush=True)
        self.should_exit = True


async def _serve_http(cluster: Cluster, config: ServeConfig) -> int:
    router = cluster.router
    if config.served_model_name:
        router.model_name = config.served_model_name
    await router.start()
    freeze_startup_heap()
    admission = Admission(config.max_queued_requests, config.queue_timeout_s)
    app = create_app(
        router,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
        metrics_require_api_key=config.metrics_require_api_key,
        admission=admission,
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        ),
        admission,
        config.drain_timeout_s,
    )
    announce = asyncio.create_task(_announce_when_ready(server, config))
    try:
        await server.serve()
    finally:
        announce.cancel()
        await router.close()
    return STOPPED_AT_ONCE_STATUS if server.force_exit else 0


async def _announce_when_ready(server: uvicorn.Server, config: ServeConfig) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    print(
        f"pdcluster is serving {config.cluster.engine.model or 'the default model'} at "
        f"http://{host}:{config.port}/v1  (Ctrl-C or SIGTERM drains and stops it)",
        flush=True,
    )
