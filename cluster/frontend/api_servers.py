"""Several API processes on one port (`pdcluster serve --api-servers N`), and the controller
that keeps them: one front end's event loop cannot keep up with a GPU's tokens (it tokenizes,
routes, formats and writes every stream), so N processes share the work, each a whole front end
(cluster.frontend.api_process) that holds the requests it accepted.

- The port: each process listens on it with SO_REUSEPORT, and the kernel spreads new
  connections over them; the controller holds the port bound (not listening) for its whole
  life, so that a restarted process finds it free.
- The nodes: each process introduces itself to every node (FrontendHello), which then streams
  that process's requests to it alone and reports its load to all of them.
- The controller (this process: Ray, the router that probes the nodes, the supervisor) tells
  every process the nodes' state (ClusterStatus) when it changes and every second, with their
  stats for /metrics. Request metrics live in prometheus_client's multiprocess files, so any
  process renders the cluster's totals; traces are written to a shared folder, so any process
  serves any of them.
- A process that dies takes its clients' connections with it: the controller tells every node
  (`frontend_gone`), which aborts that process's requests and frees their KV, and starts a
  new process (a new front-end id) after RESTART_BACKOFF_S, doubling while it keeps dying.
- A signal drains every process (each refuses new requests and finishes its own); a second
  one stops them at once.
- Admission limits are per process: `--max-queued-requests` is split over the processes."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
import zmq

from cluster.deploy.config import ServeConfig
from cluster.deploy.launcher import Cluster, driver_engine_args
from cluster.frontend.api_process import ApiProcessConfig
from cluster.frontend.cluster_status import cluster_status
from metadata.control import AsyncInbox, Outbox
from metadata.messages import ApiServerStatus, FrontendHello

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0
WATCH_INTERVAL_S = 0.2
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# A process that served this long before it died starts its backoff afresh.
STABLE_AFTER_S = 60.0
# The controller's exit status after a drain ended by a second signal.
STOPPED_AT_ONCE_STATUS = 128 + signal.SIGINT
FRONTEND_GONE_TIMEOUT_S = 90.0


@dataclass
class _Slot:
    """One API process's place: the process now in it, and its history."""

    index: int
    process: subprocess.Popen | None = None
    frontend_id: int = 0
    outbox: Outbox | None = None  # to its inbox, once it said hello
    started_at: float = 0.0
    restarts: int = 0
    deaths_in_a_row: int = 0
    restart_at: float | None = None  # when a dead process is replaced
    history: list[str] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return self.outbox is not None and self.process is not None and self.process.poll() is None


class ApiServers:
    def __init__(self, cluster: Cluster, config: ServeConfig) -> None:
        self.cluster = cluster
        self.config = config
        self.count = config.api_servers
        self.router = cluster.router
        self._slots = [_Slot(i) for i in range(self.count)]
        self._workdir = Path(tempfile.mkdtemp(prefix="pdcluster-api-"))
        self.metrics_dir = self._workdir / "metrics"
        self.metrics_dir.mkdir()
        cluster_config = config.cluster
        self.trace_dir = cluster_config.trace_dir
        self._prune_traces = False
        if cluster_config.enable_tracing and self.trace_dir is None:
            self.trace_dir, self._prune_traces = str(self._workdir / "traces"), True
        self._send_context = zmq.Context()
        self._host = self.router.inbox_host
        self._inbox = AsyncInbox(self._host, cluster.control_key)
        self.endpoint = self._inbox.endpoint
        self._port_holder: socket.socket | None = None
        self.port = config.port
        self._tasks: list[asyncio.Task] = []
        self._draining = False
        self._stopped_at_once = False
        self._done = asyncio.Event()
        self._signals = 0

    # --- lifecycle ---
    async def start(self, timeout_s: float = 300.0) -> None:
        """Start every process and wait until each has said hello."""
        self._port_holder = _hold_port(self.config.host, self.config.port)
        self.port = self._port_holder.getsockname()[1]
        self.router.on_nodes_changed = self._broadcast
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._report_status()),
        ]
        for slot in self._slots:
            self._spawn(slot)
        deadline = time.monotonic() + timeout_s
        while not all(slot.outbox is not None for slot in self._slots):
            for slot in self._slots:
                if slot.process.poll() is not None and slot.outbox is None:
                    raise RuntimeError(
                        f"API process {slot.index} exited with status "
                        f"{slot.process.returncode} before it served"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API processes did not start within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    def signalled(self, name: str) -> None:
        """A signal to the controller: the first drains every process, a second stops them."""
        self._signals += 1
        if self._signals == 1:
            self._draining = True
            print(
                f"{name}: draining {self.count} API processes: refusing new requests, waiting "
                f"up to {self.config.drain_timeout_s:g} s for those in flight (Ctrl-C again "
                "stops at once) ...",
                flush=True,
            )
            self._signal_all(signal.SIGTERM)
        else:
            self._stopped_at_once = True
            self._signal_all(signal.SIGKILL)

    async def wait(self) -> int:
        """Until the processes drained (or were stopped); the exit status."""
        await self._done.wait()
        return STOPPED_AT_ONCE_STATUS if self._stopped_at_once else 0

    async def stop(self) -> None:
        """Stop every process (killed if still running) and let go of the port."""
        self._draining = True
        self.router.on_nodes_changed = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self._slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
                slot.process.wait()
            if slot.outbox is not None:
                slot.outbox.close()
        self._inbox.close()
        self._send_context.term()
        if self._port_holder is not None:
            self._port_holder.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def pids(self) -> list[int | None]:
        """The process in each slot now (None while one is being replaced)."""
        return [
            slot.process.pid if slot.process is not None and slot.process.poll() is None else None
            for slot in self._slots
        ]

    def history(self, index: int) -> list[str]:
        return list(self._slots[index].history)

    # --- the processes ---
    def _spawn(self, slot: _Slot) -> None:
        slot.frontend_id = secrets.randbits(63)
        slot.outbox = None
        slot.started_at = time.monotonic()
        slot.restart_at = None
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        slot.process = subprocess.Popen(
            [sys.executable, "-m", "cluster.frontend.api_process"],
            stdin=subprocess.PIPE,
            env=env,
            text=True,
            # Out of the terminal's process group: a Ctrl-C reaches the controller alone, which
            # drains the processes once (a second signal to a draining process stops it).
            start_new_session=True,
        )
        slot.process.stdin.write(self._process_config(slot).to_json() + "\n")
        slot.process.stdin.flush()  # kept open: its end tells the process the controller left

    def _process_config(self, slot: _Slot) -> ApiProcessConfig:
        config, cluster = self.config, self.cluster
        engine = driver_engine_args(config.cluster.engine, cluster.spec.engine_config.device)
        serve = replace(config, cluster=replace(config.cluster, engine=engine))
        share = config.max_queued_requests
        if share is not None:
            share = math.ceil(share / self.count)
        router = self.router
        return ApiProcessConfig(
            index=slot.index,
            frontend_id=slot.frontend_id,
            controller=self.endpoint,
            inbox_host=self._host,
            control_key=cluster.control_key.hex(),
            serve=serve,
            kv_cache_tokens=router.kv_cache_tokens,
            prefill_nodes=[(n.index, n.endpoint) for n in router.prefill_nodes],
            decode_nodes=[(n.index, n.endpoint) for n in router.decode_nodes],
            port=self.port,
            metrics_dir=str(self.metrics_dir),
            trace_dir=self.trace_dir,
            prune_trace_files=self._prune_traces,
            max_queued_requests=share,
        )

    def _signal_all(self, sig: signal.Signals) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(sig)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            for slot in self._slots:
                process = slot.process
                if process is not None and process.poll() is not None:
                    await self._died(slot, process.returncode)
                elif process is None and slot.restart_at is not None and now >= slot.restart_at:
                    self._spawn(slot)
                    slot.restarts += 1
                    slot.history.append(f"restarted (restart {slot.restarts})")
                    log.warning("API process %d restarted", slot.index)
            if self._draining and all(slot.process is None for slot in self._slots):
                self._done.set()

    async def _died(self, slot: _Slot, status: int) -> None:
        frontend = slot.frontend_id
        slot.process = None
        if slot.outbox is not None:
            slot.outbox.close()
            slot.outbox = None
        if self._draining:
            return
        log.error("API process %d died (exit status %d): its streams ended", slot.index, status)
        slot.history.append(f"died (exit status {status})")
        await asyncio.to_thread(self._forget_frontend, frontend)
        if time.monotonic() - slot.started_at >= STABLE_AFTER_S:
            slot.deaths_in_a_row = 0
        slot.deaths_in_a_row += 1
        delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (slot.deaths_in_a_row - 1))
        slot.restart_at = time.monotonic() + delay
        self._broadcast()

    def _forget_frontend(self, frontend: int) -> None:
        """Every node aborts the dead process's requests, freeing their KV."""
        actors = self.cluster.prefill_actors + self.cluster.decode_actors
        refs = [actor.frontend_gone.remote(frontend) for actor in actors]
        for ref in refs:
            try:
                ray.get(ref, timeout=FRONTEND_GONE_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - a dead node is the supervisor's to handle
                log.warning("telling a node that an API process is gone failed: %s", err)

    # --- talking to them ---
    async def _receive(self) -> None:
        while True:
            msg = await self._inbox.receive()
            if isinstance(msg, FrontendHello):
                self._hello(msg)

    def _hello(self, hello: FrontendHello) -> None:
        for slot in self._slots:
            if slot.frontend_id == hello.frontend and slot.process is not None:
                if slot.outbox is not None:
                    slot.outbox.close()
                slot.outbox = Outbox(
                    hello.endpoint, self.cluster.control_key, self._send_context
                )
                slot.history.append("serving")
                self._broadcast()
                return

    async def _report_status(self) -> None:
        """Every second: the nodes' stats (fetched through the controller's router, cached a
        second) and state, to every process."""
        while True:
            try:
                await self.router.metrics.nodes.refresh()
            except Exception as err:  # noqa: BLE001 - stats are best effort
                log.warning("reading the nodes' stats failed: %s", err)
            self._broadcast()
            await asyncio.sleep(STATUS_INTERVAL_S)

    def _broadcast(self) -> None:
        status = replace(cluster_status(self.router), api_servers=self._statuses())
        for slot in self._slots:
            if slot.outbox is not None:
                slot.outbox.send(status)

    def _statuses(self) -> list[ApiServerStatus]:
        return [
            ApiServerStatus(
                slot.index,
                slot.process.pid if slot.process is not None else 0,
                slot.up,
                slot.restarts,
            )
            for slot in self._slots
        ]


def _hold_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT and never listening: it keeps the port
    for the API processes (port 0: one the OS picks), and takes no connection itself."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError("several API processes need SO_REUSEPORT, which this OS lacks")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
