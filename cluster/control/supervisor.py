"""The supervisor: replaces nodes that die, on their own resources, and keeps the survivors
serving.

The router finds a node dead (its health probe fails: process killed, actor error, serving loop
gone) or hears from a node that a channel with a peer is broken (a transfer timed out and left
operations posted; the prefill end of that pair is replaced, which frees what the pair's
survivor held for it). Then, on the supervisor's own thread:

1. the node is killed for good, if it is not dead yet (a live process could still send into
   or read from a peer's slots), and every peer is told (`peer_lost`): it ends the requests
   that involve the node and frees their slots, and what stuck transfers held;
2. after a backoff (`NodeRestartPolicy`), a new actor starts in the node's placement bundle,
   pairs with every live peer (a new pair group each: metadata.pair_group; no other pair is
   touched) and starts serving; the router then routes to it again and counts the restart;
3. a node that keeps dying (each replacement dying within `stable_after_s` of starting) waits
   twice as long each time, and after `max_restarts` such restarts in a row is left down and
   reported failed (/health, /metrics).

Ray's own actor restarts (`max_restarts`) would re-run a node's constructor only; the pairing
must be redone with the peers, so the supervisor makes new actors instead."""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from cluster.control.node_state import NodeState
from cluster.control.pairing import NodeSlot
from cluster.control.router import Router

log = logging.getLogger(__name__)
DEATH_CONFIRM_S = 15.0


@dataclass(frozen=True)
class NodeRestartPolicy:
    max_restarts: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    # A replacement that served this long has recovered: its next death starts a new count.
    stable_after_s: float = 60.0

    def delay_s(self, deaths_in_a_row: int) -> float:
        """The wait before restart number `deaths_in_a_row` (1: the first) of a run."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, deaths_in_a_row - 1))


@dataclass
class _Watch:
    """The supervisor's record of one node."""

    slot: NodeSlot
    state: NodeState
    deaths_in_a_row: int = 0
    started_at: float = field(default_factory=time.monotonic)
    # (when, what) of this node's restarts and give-ups, for reports and tests.
    history: list[tuple[float, str]] = field(default_factory=list)


# Replaces the slot's actor with a new, paired and started one, and returns what the router
# reaches it by: (endpoint, ping, stats); raises when it cannot.
Heal = Callable[[NodeSlot], tuple]
# Kills the slot's actor and tells its peers it is gone, with why.
Bury = Callable[[NodeSlot, str], None]


class Supervisor:
    def __init__(
        self,
        router: Router,
        watches: list[tuple[NodeSlot, NodeState]],
        heal: Heal,
        bury: Bury,
        policy: NodeRestartPolicy,
        peer_slot: Callable[[int], NodeSlot | None],
        answers: Callable[[NodeSlot], bool],
    ) -> None:
        """`peer_slot`: the slot of a data-plane rank (for broken channels); `answers`: whether
        a slot's actor answers a ping now."""
        self.router = router
        self.policy = policy
        self._watches = {id(state): _Watch(slot, state) for slot, state in watches}
        self._heal, self._bury, self._peer_slot, self._answers = heal, bury, peer_slot, answers
        self._events: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._due: list[tuple[float, int, NodeState]] = []  # restarts waiting for their time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        router.on_node_down = lambda node: self._events.put(("down", node))
        router.on_channels_broken = lambda node, ranks: self._events.put(("broken", (node, ranks)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._events.put(("stop", None))
        self._thread.join(timeout=30)
        self.router.on_node_down = None
        self.router.on_channels_broken = None

    def history(self, state: NodeState) -> list[tuple[float, str]]:
        return list(self._watches[id(state)].history)

    # --- the supervisor's thread ---
    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self._due[0][0] - time.monotonic() if self._due else 1.0
            try:
                kind, payload = self._events.get(timeout=max(0.0, min(wait, 1.0)))
            except queue.Empty:
                kind, payload = "", None
            try:
                if kind == "down":
                    self._down(payload, None)
                elif kind == "broken":
                    self._broken(*payload)
                self._restart_due()
            except Exception:  # noqa: BLE001 - the supervisor outlives any one failure
                log.exception("supervisor: handling %s failed", kind or "restarts")

    def _broken(self, node: NodeState, peer_ranks: tuple[int, ...]) -> None:
        """`node` reports its channel with each of `peer_ranks` broken: replace the prefill end
        of each pair (a prefill node holds nothing long-lived; its replacement frees what the
        decode end held for the pair)."""
        watch = self._watches.get(id(node))
        if watch is None:
            return
        for rank in peer_ranks:
            peer = self._peer_slot(rank)
            if peer is None:
                continue
            prefill = watch.slot if watch.slot.role == "prefill" else peer
            other = peer if prefill is watch.slot else watch.slot
            state = self._state_of(prefill)
            if state is None or not state.alive:
                continue
            if not self._answers(peer):
                # The channel broke because the peer died (a post to a closed socket fails
                # at once): the router's probe finds it, and its death frees the pair.
                log.warning(
                    "%s reports its channel with %s broken: %s is not answering",
                    watch.slot.name,
                    peer.name,
                    peer.name,
                )
                continue
            reason = (
                f"replaced: its channel with {other.name} broke (a transfer timed out and "
                "left operations posted)"
            )
            self.router.call_in_loop(self.router.node_down, state, reason)
            self._down(state, reason)

    def _down(self, node: NodeState, reason: str | None) -> None:
        watch = self._watches.get(id(node))
        if watch is None or node.restarting or node.given_up:
            return
        reason = f"{node.name} died: {reason or node.error}"
        self._bury(watch.slot, reason)
        now = time.monotonic()
        if now - watch.started_at >= self.policy.stable_after_s:
            watch.deaths_in_a_row = 0
        watch.deaths_in_a_row += 1
        if watch.deaths_in_a_row > self.policy.max_restarts:
            self._give_up(watch, f"it died {watch.deaths_in_a_row} times in a row")
            return
        delay = self.policy.delay_s(watch.deaths_in_a_row)
        node.restarting = True
        watch.history.append((now, f"down; restart in {delay:g} s"))
        log.warning("%s; replacing it in %g s", reason, delay)
        heapq.heappush(self._due, (now + delay, id(node), node))

    def _restart_due(self) -> None:
        while self._due and self._due[0][0] <= time.monotonic() and not self._stop.is_set():
            _, _, node = heapq.heappop(self._due)
            watch = self._watches[id(node)]
            started = time.monotonic()
            try:
                endpoint, ping, stats = self._heal(watch.slot)
            except Exception as err:  # noqa: BLE001 - a replacement that fails counts as a death
                log.error("%s: its replacement failed: %s", node.name, err)
                node.error = f"replacement failed: {err}".splitlines()[0][:300]
                node.restarting = False
                watch.history.append((time.monotonic(), f"replacement failed: {err}"))
                watch.started_at = started
                self._down(node, node.error)
                continue
            watch.started_at = time.monotonic()
            node.restarts += 1
            self.router.call_in_loop(self.router.revive, node, endpoint, ping, stats)
            watch.history.append(
                (watch.started_at, f"restarted in {watch.started_at - started:.1f} s")
            )
            log.warning(
                "%s replaced in %.1f s (restart %d)",
                node.name,
                watch.started_at - started,
                node.restarts,
            )

    def _give_up(self, watch: _Watch, why: str) -> None:
        node = watch.state
        node.given_up = True
        node.restarting = False
        message = (
            f"not restarted again: {why} (max {self.policy.max_restarts} restarts in a row); "
            f"last error: {node.error}"
        )
        node.error = message[:300]
        watch.history.append((time.monotonic(), "given up"))
        log.error("%s: %s", node.name, message)

    def _state_of(self, slot: NodeSlot) -> NodeState | None:
        for watch in self._watches.values():
            if watch.slot is slot:
                return watch.state
        return None


def kill_for_good(actor, timeout_s: float = DEATH_CONFIRM_S) -> None:
    """Kill `actor` and wait until Ray reports it dead, so that nothing it posted can still
    move data when its peers free their slots."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=1.0)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            return
        except Exception:  # noqa: BLE001 - a timeout: still dying
            pass
        time.sleep(0.1)
    log.error("an actor killed %g s ago still answers", timeout_s)
