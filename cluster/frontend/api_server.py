"""The HTTP server of one front end: uvicorn on uvloop (where installed) serving the
OpenAI-compatible app over a router, draining on the first SIGTERM or SIGINT and stopping at
once on a second. `pdcluster serve` runs one in its own process, or one in each of its API
processes (cluster.frontend.api_process)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from cluster.control.router import Router
from cluster.deploy.config import ServeConfig
from cluster.frontend.admission import Admission
from cluster.frontend.openai_api import create_app
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


async def run_api(
    router: Router,
    config: ServeConfig,
    *,
    sock: socket.socket | None = None,
    max_queued_requests: int | None = None,
    api_server: int | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve `router` over HTTP until stopped (drained, or at once): this process's only front
    end, or one of several API processes (`sock`: its socket on their shared port;
    `api_server`: its index; `max_queued_requests`: its share of the limit, else the
    config's). Returns the exit status."""
    await router.start()
    freeze_startup_heap()
    if sock is None:
        max_queued_requests = config.max_queued_requests
    admission = Admission(max_queued_requests, config.queue_timeout_s)
    app = create_app(
        router,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
        metrics_require_api_key=config.metrics_require_api_key,
        admission=admission,
        api_server=api_server,
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
        quiet=api_server is not None,
    )
    announce = asyncio.create_task(_when_started(server, on_ready))
    try:
        await server.serve(sockets=None if sock is None else [sock])
    finally:
        announce.cancel()
        await router.close()
    return STOPPED_AT_ONCE_STATUS if server.force_exit else 0


async def _when_started(server: uvicorn.Server, on_ready: Callable[[], None] | None) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    if on_ready is not None:
        on_ready()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM or SIGINT drains before it stops, and
    a second one stops it at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        admission: Admission,
        drain_timeout_s: float,
        quiet: bool = False,
    ) -> None:
        """`quiet`: say nothing of the drain (one of several API processes, whose controller
        speaks for them)."""
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s
        self.quiet = quiet
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
        if not self.quiet:
            print(
                f"{signal_name}: draining: refusing new requests, waiting up to "
                f"{self.drain_timeout_s:g} s for {self.admission.in_flight} in flight "
                f"(Ctrl-C again stops at once) ...",
                flush=True,
            )
        ended = await self.admission.drain(self.drain_timeout_s)
        if ended:
            log.warning("the drain timeout ended %d unfinished requests", ended)
            if not self.quiet:
                print(f"the drain timeout ended {ended} unfinished requests", flush=True)
        self.should_exit = True
