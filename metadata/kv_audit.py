"""Keeping a node's KV slots accounted for: slots that a timed-out transfer may still touch
wait in a `Quarantine` until their peer is gone, and a periodic `KVAudit` compares each pool's
used slots with what the node's live requests (and the quarantine) hold, logging and counting
any difference. Both live on the node's serving thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.request import Request

log = logging.getLogger(__name__)
DEFAULT_AUDIT_INTERVAL_S = 10.0


@dataclass
class Held:
    """A request whose slots (and metadata row) a transfer left posted by a timeout may still
    read or write, held until its peer is replaced or the node stops."""

    req: Request
    room: int
    peer: int
    meta_row: int | None
    reason: str
    since: float


class Quarantine:
    """Requests held per peer. A posted p2p operation cannot be cancelled, so a timed-out
    transfer's slots are freed only once the peer's process is gone (it can then neither send
    into them nor receive from them): `release_peer` when the cluster reports the peer lost."""

    def __init__(self) -> None:
        self._held: dict[int, list[Held]] = {}

    def hold(self, req: Request, room: int, peer: int, reason: str, meta_row: int | None = None):
        self._held.setdefault(peer, []).append(
            Held(req, room, peer, meta_row, reason, time.monotonic())
        )
        log.warning(
            "room %s: %d KV slots held until rank %d is replaced: %s",
            room,
            len(req.slots),
            peer,
            reason,
        )

    def release_peer(self, peer: int) -> list[Held]:
        """Everything held for `peer`, now safe to free (the caller frees it)."""
        return self._held.pop(peer, [])

    def requests(self) -> list[Held]:
        return [held for group in self._held.values() for held in group]

    def degraded(self) -> str | None:
        """Why the node is degraded, while anything is held."""
        held = self.requests()
        if not held:
            return None
        first = min(held, key=lambda h: h.since)
        slots = sum(len(h.req.slots) for h in held)
        return (
            f"{len(held)} transfer(s) stuck past their timeout hold {slots} KV slots until "
            f"their peer is replaced (room {first.room}, rank {first.peer}: {first.reason})"
        )


@dataclass(frozen=True)
class PoolCount:
    """One pool: the slots (or rows) its allocator counts as used, and those the node's live
    requests and quarantine hold."""

    pool: str
    used: int
    held: int


class KVAudit:
    """Every `interval_s`, compares each pool's used count with what is held; a difference
    (slots leaked, or freed while still held) is logged and counted in `mismatches`."""

    def __init__(self, node_name: str, interval_s: float = DEFAULT_AUDIT_INTERVAL_S) -> None:
        self.node_name = node_name
        self.interval_s = interval_s
        self.audits = 0
        self.mismatches = 0
        self.unaccounted = 0  # the last audit's used - held, summed over pools
        self._next = time.monotonic() + interval_s

    def tick(self, count: Callable[[], list[PoolCount]]) -> None:
        if self.interval_s <= 0 or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.interval_s
        self.run(count())

    def run(self, pools: list[PoolCount]) -> list[PoolCount]:
        """Audit `pools` now; returns the ones that differ."""
        self.audits += 1
        wrong = [p for p in pools if p.used != p.held]
        self.unaccounted = sum(p.used - p.held for p in wrong)
        if wrong:
            self.mismatches += 1
            log.error(
                "%s: KV audit: %s",
                self.node_name,
                "; ".join(f"{p.pool} has {p.used} used but {p.held} held" for p in wrong),
            )
        return wrong

    def stats(self) -> dict:
        return {
            "kv_audits": self.audits,
            "kv_audit_mismatches": self.mismatches,
            "kv_unaccounted": self.unaccounted,
        }


def request_pools(
    target_used: int,
    requests: list[Request],
    speculator,
    rows: tuple[int, int] | None = None,
    cached: Iterable[int] = (),
) -> list[PoolCount]:
    """The PoolCounts of a node whose `requests` and prefix cache (`cached`: the slots it
    holds) hold all its slots: the target pool, each draft depth's pool (`speculator`:
    spec.MultiLayerEagleWorker or None) and, with `rows` (used, held), the metadata rows."""
    # Distinct slots: parallel samples of one prompt hold its slots together, and requests
    # read the cache's slots of their prefix.
    held = set(cached).union(*(r.slots for r in requests))
    counts = [PoolCount("target", target_used, len(held))]
    for depth, runner in enumerate(speculator.depths if speculator is not None else []):
        held = set(speculator.prefix_drafts.cached_slots(depth))
        for req in requests:
            state = req.spec_state
            if state is not None and depth < len(state.seqs):
                held.update(state.seqs[depth].slots)
        counts.append(PoolCount(f"draft-{depth}", runner.kv_pool.allocator.num_used, len(held)))
    if rows is not None:
        counts.append(PoolCount("metadata_rows", *rows))
    return counts
