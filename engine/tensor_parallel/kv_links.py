"""One process's channels to the ranks of other nodes that it exchanges KV heads with: a link per
route (engine/tensor_parallel/kv_routes.py) other than (0, 0), which crosses the nodes' own
channel. Every rank of a node holds one `KVLinks` over its own KV pool: rank 0 calls it
directly, the followers when rank 0 orders them to (engine/tensor_parallel/link_orders.py).

A link is a two-process gloo group of its own, made on the cluster's rendezvous store under a
key of the node pair, its epoch and the two ranks, so a replaced node re-pairs each link as it
re-pairs the node channel. Its two ends post in the order of the transfers (rooms), and gloo
also matches the room's tag, so a transfer that one side drops never takes another's data.

Buffers are the link's own on both ends: a sending rank copies its heads at the slots into a
fresh tensor when it posts (the prefill node frees the slots when its own part of the transfer
ends, without waiting for the followers'), and a receiving rank lands them in a staging tensor
that it writes into its pool only when rank 0 says the request is admitted (`land`). So no
follower ever writes a slot after rank 0 handed it to another request, whatever happens to
the transfer. The operations that no one waits for (sends, and receives dropped) are each
waited for by a thread of their own, holding their buffers, and let go as each ends, whatever
the order: one that is never matched holds only its own buffer, and for the transfer timeout
at most, after which the link is broken (its pair's transfers fail, and the node is replaced),
or until the peer's process goes (its sockets close)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from engine.scheduling.kv_pool import KVPool
from engine.tensor_parallel.kv_routes import KVRoute

log = logging.getLogger(__name__)

# The shortest wait for heads past their deadline: a wait of zero is c10d's "no timeout of its
# own", which waits the link group's timeout (the whole transfer timeout) instead.
MIN_WAIT_S = 0.001


def _tag(room: int) -> int:
    # gloo tags are non-negative 32-bit ints; rooms are 63-bit (as metadata.peer_workers).
    return room & 0x7FFFFFFF


@dataclass(frozen=True)
class LinkSpec:
    """One end of a link: which rank of this node holds it, toward which node (`peer`, its
    data-plane rank), for which route, and where in this rank's pool the route's heads lie."""

    peer: int
    rank: int
    route: KVRoute
    sends: bool  # the prefill end
    key: str  # the link group's prefix on the store
    local_first: int  # the route's first head in this rank's pool


@dataclass(frozen=True)
class LinkPlan:
    """Every link a node's ranks open at one pairing (each rank opens its own)."""

    store_host: str
    store_port: int
    timeout_s: float
    # The interface gloo's sockets use where every process runs on this host (loopback).
    interface: str | None
    links: tuple[LinkSpec, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LinkPlan:
        raw = json.loads(data.decode())
        links = tuple(
            LinkSpec(**{**link, "route": KVRoute(**link["route"])}) for link in raw["links"]
        )
        return cls(raw["store_host"], raw["store_port"], raw["timeout_s"], raw["interface"], links)


@dataclass
class _Receive:
    staging: torch.Tensor
    work: dist.Work | None
    error: str | None = None


class KVLink:
    """One link: its group, the receives posted on it by room, and the operations no one waits
    for (sends, receives dropped), each waited for by a thread of its own with its buffer, so
    that the buffer outlives it and an operation never matched holds up no other. A wait ends
    within `timeout` (the transfer timeout): one that times out breaks the link (gloo closes
    the group's pairs, which ends every operation on it)."""

    def __init__(self, spec: LinkSpec, group: dist.ProcessGroupGloo, timeout: timedelta) -> None:
        self.spec = spec
        self.group = group
        self.timeout = timeout
        self.peer_in_pair = 1 if spec.sends else 0
        self.receives: dict[int, _Receive] = {}
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Operations handed to `keep_until_done` that have not ended."""
        with self._lock:
            return self._in_flight

    def keep_until_done(self, work: dist.Work, buffer: torch.Tensor) -> None:
        with self._lock:
            self._in_flight += 1
        threading.Thread(
            target=self._wait, args=(work, buffer), name="kv-link-wait", daemon=True
        ).start()

    def close(self) -> None:
        """Forgotten: its receives still posted are held until they end, as its sends are (the
        group goes with the last of them)."""
        for receive in self.receives.values():
            if receive.work is not None:
                self.keep_until_done(receive.work, receive.staging)
        self.receives.clear()

    def _wait(self, work: dist.Work, _buffer: torch.Tensor) -> None:
        try:
            work.wait(timeout=self.timeout)
        except Exception as err:  # noqa: BLE001 - the peer went, or never matched it
            self.broken = f"{type(err).__name__}: {err}"
            log.warning("KV link %s: %s", self.spec.key, self.broken)
        finally:
            with self._lock:
                self._in_flight -= 1


class KVLinks:
    """This rank's links, by peer node; counts the bytes it sent (by decode rank) and landed
    (by prefill rank)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.links: dict[int, list[KVLink]] = {}
        self.sent: Counter[int] = Counter()
        self.landed: Counter[int] = Counter()

    def in_flight(self, peer: int) -> int:
        """Operations posted on this rank's links with `peer` that have not ended: receives
        waiting for their landing, and sends and dropped receives (each holding its buffer)."""
        return sum(len(link.receives) + link.in_flight for link in self.links.get(peer, []))

    def open(self, plan: LinkPlan, rank: int) -> str | None:
        """Open this rank's links of `plan` (replacing any this rank had with their peers),
        all at once: each waits for its other end. Returns why one failed, or None."""
        mine = [spec for spec in plan.links if spec.rank == rank]
        if not mine:
            return None
        if plan.interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", plan.interface)
        timeout = timedelta(seconds=plan.timeout_s)

        def make(spec: LinkSpec) -> dist.ProcessGroupGloo:
            store = dist.TCPStore(
                plan.store_host, plan.store_port, is_master=False, timeout=timeout
            )
            prefixed = dist.PrefixStore(spec.key, store)
            return dist.ProcessGroupGloo(prefixed, 0 if spec.sends else 1, 2, timeout)

        try:
            with ThreadPoolExecutor(len(mine)) as pool:
                groups = list(pool.map(make, mine))
        except Exception as err:  # noqa: BLE001 - reported to rank 0, which fails the pairing
            return f"opening its KV links failed: {type(err).__name__}: {err}"
        for peer in {spec.peer for spec in mine}:
            self.forget(peer)
        for spec, group in zip(mine, groups):
            self.links.setdefault(spec.peer, []).append(KVLink(spec, group, timeout))
        return None

    def forget(self, peer: int) -> None:
        """Drop the links with `peer` (gone or re-paired); what they still hold is released as
        their operations end."""
        for link in self.links.pop(peer, []):
            link.close()

    def send(self, peer: int, room: int, slots: torch.Tensor | None, num_tokens: int) -> None:
        """Post this rank's heads at `slots` to each decode rank it sends to on `peer`
        (`slots` None: zeros, for a void transfer, whose content means nothing)."""
        for link in self.links.get(peer, []):
            if not link.spec.sends:
                continue
            route = link.spec.route
            if slots is None:
                piece = torch.zeros(self._shape(route, num_tokens), dtype=self.pool.dtype)
            else:
                rows = self.pool.kv_buffer.index_select(0, slots)
                lo = link.spec.local_first
                piece = rows[:, :, :, lo : lo + route.num_heads].contiguous()
            try:
                if link.broken is not None:
                    raise RuntimeError(link.broken)
                work = link.group.send([_as_bytes(piece)], link.peer_in_pair, _tag(room))
            except Exception as err:  # noqa: BLE001 - the decode side's wait fails it
                link.broken = f"{type(err).__name__}: {err}"
                log.warning("room %s: KV link %s: %s", room, link.spec.key, link.broken)
                continue
            link.keep_until_done(work, piece)
            self.sent[route.decode_rank] += piece.numel() * piece.element_size()

    def expect(self, peer: int, room: int, num_tokens: int) -> None:
        """Post the receives of this rank's heads of an announced transfer from `peer`."""
        for link in self.links.get(peer, []):
            if link.spec.sends:
                continue
            earlier = link.receives.pop(room, None)
            if earlier is not None and earlier.work is not None:
                # The room announced again: the receive posted first still holds its buffer.
                link.keep_until_done(earlier.work, earlier.staging)
            staging = torch.empty(self._shape(link.spec.route, num_tokens), dtype=self.pool.dtype)
            receive = _Receive(staging, None)
            try:
                if link.broken is not None:
                    raise RuntimeError(link.broken)
                receive.work = link.group.recv([_as_bytes(staging)], 0, _tag(room))
            except Exception as err:  # noqa: BLE001 - reported when the request lands
                receive.error = f"{type(err).__name__}: {err}"
            link.receives[room] = receive

    def land(
        self, peer: int, room: int, slots: torch.Tensor | None, timeout_s: float
    ) -> str | None:
        """Wait (up to `timeout_s`) for this rank's heads of `room` from `peer` and write them
        at `slots` of its pool; `slots` None: drop them (the request does not run). Returns
        why they did not land, or None."""
        deadline, failure = time.monotonic() + timeout_s, None
        for link in self.links.get(peer, []):
            receive = link.receives.pop(room, None)
            if link.spec.sends or receive is None:
                continue
            route = link.spec.route
            error = receive.error
            if error is None and slots is not None and failure is None:
                try:
                    left = max(MIN_WAIT_S, deadline - time.monotonic())
                    receive.work.wait(timeout=timedelta(seconds=left))
                except Exception as err:  # noqa: BLE001 - the link is out of order for good
                    error = link.broken = f"{type(err).__name__}: {err}"
            elif receive.work is not None:
                # Dropped, or after another link failed: held until it ends.
                link.keep_until_done(receive.work, receive.staging)
                continue
            if error is not None:
                failure = failure or (
                    f"KV heads {route.first_head}..{route.first_head + route.num_heads - 1} "
                    f"from prefill rank {route.prefill_rank} did not land: {error}"
                )
                continue
            lo = link.spec.local_first
            heads = self.pool.kv_buffer[:, :, :, lo : lo + route.num_heads]
            heads.index_copy_(0, slots, receive.staging)
            staged = receive.staging
            self.landed[route.prefill_rank] += staged.numel() * staged.element_size()
        return failure

    def _shape(self, route: KVRoute, num_tokens: int) -> tuple[int, ...]:
        pool = self.pool
        return (num_tokens, pool.num_layers, 2, route.num_heads, pool.head_dim)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)


def slot_index(slots: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(slots, dtype=np.int64))
