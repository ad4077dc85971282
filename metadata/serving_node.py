"""What every serving node shares, whatever its role: its identity, the one thread that owns its
engine and sockets, the health and clock answers the router asks for, the data-plane channels it
opens with each peer (a pair group per peer: metadata.pair_group) and re-opens when a peer is
replaced, its fault injection, and the checks that its pools are empty and accounted for."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.cpu_tuning import freeze_startup_heap
from engine.loading.loader import ModelSpec
from engine.scheduling.kv_cache import KVCacheManager
from engine.tracing import clock_ns
from metadata.buffers import MetadataBuffers
from metadata.control import Inbox
from metadata.faults import FaultInjector
from metadata.kv_audit import KVAudit, PoolCount, Quarantine
from metadata.loop_clock import LoopClock
from metadata.node_common import NodeOptions, open_channels, transfer_spec
from metadata.pair_group import PairLink, open_pair_channel
from metadata.rank_kv import RankKV, repair_rank_kv
from metadata.transfer import KVReceiver, KVSender

log = logging.getLogger(__name__)
PEER_LOST_WAIT_S = 60.0


# How long a serving loop blocks on its inbox: not at all while it has compute to run, briefly
# while it only waits on transfers (rather than spin, so that the transfer threads get the
# interpreter), longer when idle.
IDLE_POLL_MS = 5
WAITING_POLL_MS = 1


def poll_timeout_ms(busy: bool, waiting: bool) -> int:
    if busy:
        return 0
    return WAITING_POLL_MS if waiting else IDLE_POLL_MS


@dataclass(frozen=True)
class NodeHealth:
    """A node's answer to the router's health probe (a Ray call). `degraded`: why the node
    serves with a fault (a transfer stuck past its timeout), else None. `broken_peers`: the
    ranks whose channel with this node is out of order (a timeout left operations posted): the
    cluster replaces the prefill end of each such pair."""

    degraded: str | None = None
    broken_peers: tuple[int, ...] = ()


class ServingNode:
    """Subclasses set `spec`, `kv_cache`, `metadata`, `inbox`, `speculator`, `num_draft_steps`
    and `rank_kv` in their constructor and implement `_serve`, `_open_channel`,
    `_drop_peer`, `_drop_frontend` and `_pool_counts`; `_serve` calls `_housekeeping` once per
    iteration."""

    spec: ModelSpec
    kv_cache: KVCacheManager
    metadata: MetadataBuffers
    inbox: Inbox
    speculator: Any  # spec.MultiLayerEagleWorker or None (metadata does not import spec)
    num_draft_steps: int
    rank_kv: RankKV

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.rank = -1
        self._channel: KVSender | KVReceiver | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.faults = FaultInjector(options.name)
        self.quarantine = Quarantine()
        self.kv_audit = KVAudit(options.name, options.kv_audit_interval_s)
        self.loop_clock = LoopClock()
        # Work that Ray calls hand to the serving thread, which owns the engine and sockets.
        self._events: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def _receive(self, timeout_ms: int) -> list[Any]:
        """The inbox's messages, waiting up to `timeout_ms` for one; the loop's clock charges
        the time until now to "other" and the receive to "waiting" (metadata.loop_clock)."""
        self.loop_clock.lap("other")
        messages = self.inbox.receive(timeout_ms)
        self.loop_clock.lap("waiting")
        return messages

    def _loop_stats(self, engine: Any) -> dict:
        """For stats(): where the serving thread's time went, and `engine`'s forward steps by
        kind (engine.step_counts)."""
        return {"loop_seconds": self.loop_clock.stats(), "steps": engine.step_counts().as_dict()}

    def describe(self) -> dict:
        spec = transfer_spec(self.spec, self.num_draft_steps)
        return {"endpoint": self.inbox.endpoint, "spec": spec.to_dict()}

    def pair_with(self, rank: int, links: list[PairLink]) -> None:
        """Take data-plane rank `rank` and open a channel with each peer of `links` (a pair
        group each, made together with the peer, which calls `pair_with` or `repair`), then
        every rank's KV links with them (metadata.rank_kv). Before the node starts."""
        self.rank = rank
        self._channel = self._open_channel()
        if not links:
            return
        with ThreadPoolExecutor(len(links)) as pool:
            # Concurrently: each group waits for its peer, and peers pair in any order.
            channels = list(pool.map(self._open_pair, links))
        for link, channel in zip(links, channels):
            self._channel.attach(link.peer_rank, channel)
        open_channels(self._channel, [link.peer_rank for link in links], self._timeout_s)
        self.rank_kv.pair(links, rank)

    def repair(self, link: PairLink) -> None:
        """The peer at `link.peer_rank` was replaced: open a new channel with it, and the
        ranks' KV links (on the serving thread, which drives the ranks). Whatever was in
        flight with its predecessor was dropped by `peer_lost`."""
        channel = self._open_pair(link)
        self._channel.attach(link.peer_rank, channel)
        open_channels(self._channel, [link.peer_rank], self._timeout_s)
        # The opening waits up to the transfer timeout for the peer's ends, after whatever
        # step the serving thread runs: the repair returns once the links are open (or failed).
        self._on_serving_thread(
            lambda: repair_rank_kv(self.rank_kv, link, self.rank),
            PEER_LOST_WAIT_S + self._timeout_s,
        )

    def peer_lost(self, index: int, rank: int, reason: str) -> None:
        """(Ray call) The peer node `index` (data-plane rank `rank`) is dead: every request
        that involves it ends with `reason`, and every slot held for it is freed (a dead
        process can neither write into nor read from them). Returns once the serving thread
        has done so, so that it happens before a replacement pairs (up to PEER_LOST_WAIT_S
        while a long step runs)."""
        if self._channel is not None:
            self._channel.forget_peer(rank, reason)
        self._on_serving_thread(lambda: self._peer_gone(index, rank, reason))

    def _peer_gone(self, index: int, rank: int, reason: str) -> None:
        self._drop_peer(index, rank, reason)
        self.rank_kv.forget(rank)

    def frontend_gone(self, frontend: int) -> None:
        """(Ray call) The front end `frontend` (an API process) died, and its clients'
        connections with it: abort every request it holds here, freeing their KV (and the
        prefill node's), and close its socket. Returns once the serving thread has done so."""
        self._on_serving_thread(lambda: self._drop_frontend(frontend))

    def _on_serving_thread(self, work: Callable[[], None], wait_s: float | None = None) -> None:
        """Run `work` on the serving thread, which owns the engine and sockets, and wait for it
        (up to `wait_s`, by default PEER_LOST_WAIT_S while a long step runs)."""
        done = threading.Event()

        def run() -> None:
            try:
                work()
            finally:
                done.set()

        self._events.put(run)
        if self._thread is not None and self._thread.is_alive():
            done.wait(PEER_LOST_WAIT_S if wait_s is None else wait_s)

    def _open_pair(self, link: PairLink):
        return open_pair_channel(
            link,
            self.rank,
            self.spec.engine_config.device,
            through_host=self.options.transfer_through_host,
            timeout_s=self._timeout_s,
        )

    @property
    def _timeout_s(self) -> float:
        return self.options.transfer_timeout_s

    def start(self) -> None:
        freeze_startup_heap()
        self._thread = threading.Thread(target=self._serve, name=self.options.name, daemon=True)
        self._thread.start()

    def ping(self) -> str:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"{self.options.name}: its serving loop is not running")
        error = self._serving_error()
        if error is not None:
            raise RuntimeError(f"{self.options.name}: {error}")
        return "ok"

    def _serving_error(self) -> str | None:
        """Why the node cannot serve although its loop runs (a worker of its is gone)."""
        return None

    def health(self) -> NodeHealth:
        """The router's probe: raises when the serving loop is gone, else says whether the node
        is degraded and which channels are broken. A channel that a timed-out transfer broke
        is reported broken only once the serving loop has settled that transfer (its slots
        held in the quarantine): the cluster then replaces the prefill end, which frees them,
        so the report must not come first. Read in this order, since a transfer's thread
        marks its handle before the channel, and the loop quarantines before it forgets."""
        self.ping()
        broken = self._channel.broken_peers() if self._channel is not None else {}
        unsettled = self._unsettled_peers() if broken else set()
        reasons = [self.quarantine.degraded()]
        reasons += [f"channel with rank {rank}: {why}" for rank, why in sorted(broken.items())]
        degraded = "; ".join(r for r in reasons if r) or None
        return NodeHealth(degraded, tuple(sorted(set(broken) - unsettled)))

    def _unsettled_peers(self) -> set[int]:
        """The peers of transfers that timed out (operations left posted) and that the serving
        loop has not settled yet. A node that holds nothing for its transfers has none."""
        return set()

    def clock_ns(self) -> int:
        """This process's trace clock, for the router to align this node's timelines."""
        return clock_ns()

    def kv_is_empty(self) -> bool:
        drafts_empty = self.speculator is None or self.speculator.is_empty()
        return (
            self.kv_cache.is_empty()
            and drafts_empty
            and self.metadata.num_free == self.metadata.num_rows
        )

    def audit_kv(self) -> list[dict]:
        """(Ray call) Audit the pools now, on the serving thread; the pools that differ."""
        done: queue.SimpleQueue[list[PoolCount]] = queue.SimpleQueue()
        self._events.put(lambda: done.put(self.kv_audit.run(self._pool_counts())))
        return [vars(count) for count in done.get(timeout=30)]

    def _housekeeping(self) -> None:
        """Once per serving iteration: apply what Ray calls handed over, and audit the pools
        when due."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            event()
        self.kv_audit.tick(self._pool_counts)

    def _health_stats(self) -> dict:
        """The fault-related figures every node's stats() carries."""
        return {
            **self.kv_audit.stats(),
            "kv_quarantined": sum(len(h.req.slots) for h in self.quarantine.requests()),
            "transfers_stuck": len(self.quarantine.requests()),
            "faults_injected": self.faults.transfers_failed,
            **self.kv_cache.prefix_cache_stats(),
        }

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()

    def _open_channel(self) -> KVSender | KVReceiver:
        raise NotImplementedError

    def _serve(self) -> None:
        raise NotImplementedError

    def _drop_peer(self, index: int, rank: int, reason: str) -> None:
        raise NotImplementedError

    def _drop_frontend(self, frontend: int) -> None:
        raise NotImplementedError

    def _pool_counts(self) -> list[PoolCount]:
        raise NotImplementedError
