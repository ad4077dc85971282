"""What rank 0 tells its followers to do with their KV links (engine/tensor_parallel/kv_links.py)
between forwards: open them at a pairing, post a transfer's sends or receives, land or drop a
transfer's heads, forget a peer. Every rank, rank 0 included, then does the same on its own
links; an order whose outcome rank 0 must know (an opening, a landing) ends with every rank's
status gathered onto rank 0.

An order is the forward header's fixed seven int64 (forward_plan.HEADER_SIZE), then the slots
(int64) or the plan (JSON bytes) where it has some."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from engine.tensor_parallel.group import RankGroup
from engine.tensor_parallel.kv_links import KVLinks, LinkPlan
from engine.tensor_parallel.orders import Order

log = logging.getLogger(__name__)
# Each rank's status (JSON: its error, the bytes it landed by prefill rank) in this many bytes.
STATUS_BYTES = 1024


@dataclass(frozen=True)
class LinkOrder:
    """`kind`: one of forward_plan.Order's link orders. `slots` None on a send: void (zeros);
    on a landing: drop. `timeout_s`: how long a landing waits for the heads."""

    kind: int
    peer: int = 0
    room: int = 0
    num_tokens: int = 0
    slots: torch.Tensor | None = None
    plan: bytes = b""
    timeout_s: float = 0.0

    def header(self) -> list[int]:
        has_slots = self.slots is not None
        timeout_ms = int(self.timeout_s * 1000)
        return [
            self.kind,
            self.peer,
            self.room,
            self.num_tokens,
            has_slots,
            len(self.plan),
            timeout_ms,
        ]

    @classmethod
    def receive(cls, group: RankGroup, header: list[int]) -> LinkOrder:
        """A follower: the rest of the order whose header it has."""
        kind, peer, room, num_tokens, has_slots, plan_len, timeout_ms = header
        slots = plan = None
        if has_slots:
            slots = torch.empty(num_tokens, dtype=torch.int64)
            group.broadcast(slots)
        if plan_len:
            plan = torch.empty(plan_len, dtype=torch.uint8)
            group.broadcast(plan)
        return cls(
            kind,
            peer,
            room,
            num_tokens,
            slots,
            b"" if plan is None else plan.numpy().tobytes(),
            timeout_ms / 1000,
        )

    def announce(self, group: RankGroup) -> None:
        """Rank 0: send the order, before taking part in it."""
        group.broadcast(torch.tensor(self.header(), dtype=torch.int64))
        if self.slots is not None:
            group.broadcast(self.slots.to(torch.int64).contiguous())
        if self.plan:
            group.broadcast(torch.frombuffer(bytearray(self.plan), dtype=torch.uint8))


@dataclass(frozen=True)
class RankStatus:
    """One rank's outcome of an order: why it failed, and the bytes it landed by prefill
    rank."""

    error: str | None = None
    landed: dict[int, int] | None = None


def run_link_order(links: KVLinks, order: LinkOrder, rank: int) -> RankStatus:
    """Do `order` on this rank's links. Where the order gathers the ranks' statuses, a failure
    here is this rank's status rather than an exception: every rank still reaches the gather,
    so the ranks stay in step for the next order, and rank 0 learns which failed and why.
    Any other order raises."""
    try:
        return _run(links, order, rank)
    except Exception as err:  # noqa: BLE001 - see above
        if not gathers_status(order):
            raise
        log.exception("rank %d: link order %s failed", rank, Order(order.kind).name)
        return RankStatus(f"{type(err).__name__}: {err}")


def _run(links: KVLinks, order: LinkOrder, rank: int) -> RankStatus:
    if order.kind == Order.OPEN_LINKS:
        return RankStatus(links.open(LinkPlan.from_bytes(order.plan), rank))
    if order.kind == Order.SEND_KV:
        links.send(order.peer, order.room, order.slots, order.num_tokens)
    elif order.kind == Order.RECV_KV:
        links.expect(order.peer, order.room, order.num_tokens)
    elif order.kind == Order.LAND_KV:
        before = dict(links.landed)
        error = links.land(order.peer, order.room, order.slots, order.timeout_s)
        landed = {p: n - before.get(p, 0) for p, n in links.landed.items() if n != before.get(p)}
        return RankStatus(error, landed)
    elif order.kind == Order.FORGET_PEER:
        links.forget(order.peer)
    return RankStatus()


def gathers_status(order: LinkOrder) -> bool:
    return order.kind in (Order.OPEN_LINKS, Order.LAND_KV)


def gather_status(group: RankGroup, status: RankStatus) -> list[RankStatus]:
    """Every rank's status, in rank order (every rank calls it; only rank 0 reads them)."""
    encoded = encode_status(status)
    buffer = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    buffer[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    statuses = []
    for part in group.all_gather(buffer):
        raw = part.numpy().tobytes().rstrip(b"\0")
        error, landed = json.loads(raw.decode())
        statuses.append(RankStatus(error, {int(p): n for p, n in landed.items()}))
    return statuses


def encode_status(status: RankStatus) -> bytes:
    """`status` as JSON of at most STATUS_BYTES bytes: an error message too long for it is cut
    (its start still names the rank's failure) until its encoding, escapes included, fits."""
    encoded = json.dumps([status.error, status.landed or {}]).encode()
    error = status.error or ""
    while len(encoded) > STATUS_BYTES:
        error = error[: min(len(error) // 2, STATUS_BYTES)]
        encoded = json.dumps([error, {}]).encode()
    return encoded
