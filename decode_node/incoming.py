"""A decode node's transfers in flight: the requests whose KV is on its way from a prefill node,
from the announcement (receives posted into their preallocated slots, or into scratch for one
that no request takes) to the end of their transfers, and the totals of those that ended.

Receives are posted in announcement order, which is each prefill node's send order (NCCL
matches a pair's operations by order alone): an announcement that cannot be received at all
breaks the channel from its rank, and one that no request takes is received into scratch, so
that later transfers on that channel still land where they should."""

from __future__ import annotations

import logging
from collections.abc import Callable

from decode_node.announcements import refusal, unreceivable
from decode_node.receives import landing_error, receive_pools, scratch_sizes
from decode_node.reuse import received_tokens
from decode_node.tracked import Tracked
from engine.errors import RankFailedError
from engine.model_runner import ModelRunner
from engine.tracing import set_time
from metadata.buffers import MetadataBuffers
from metadata.faults import FaultInjector
from metadata.messages import TransferAnnounce
from metadata.node_common import NodeOptions
from metadata.node_metrics import TransferTotals
from metadata.transfer import KVReceiver, TransferState
from metadata.whole_kv import incoming_pools, wire_pool
from spec import MultiLayerEagleWorker

log = logging.getLogger(__name__)


class IncomingTransfers:
    def __init__(
        self,
        runner: ModelRunner,
        speculator: MultiLayerEagleWorker | None,
        metadata: MetadataBuffers,
        max_len: int,
        faults: FaultInjector,
    ) -> None:
        # Its KV pool is the target's; with ranks, the KV lands whole in a staging pool and
        # the runner writes each rank's heads from it (metadata.whole_kv).
        self.runner = runner
        self.kv_pool = runner.kv_pool
        # The target KV's messages' shape (whole heads, whatever this node's ranks).
        self.wire_pool = wire_pool(runner)
        self.speculator = speculator
        self.metadata = metadata
        self.max_len = max_len
        self.faults = faults
        self.receiver: KVReceiver | None = None  # the data-plane channel, once opened
        # Each prefill node's rank in the data-plane group, the only rank its transfers may
        # come from (DecodeNode.connect).
        self.prefill_ranks: dict[int, int] = {}
        # Requests asked of a prefill node whose transfer has not been acted on yet.
        self.requests: list[Tracked] = []
        self.totals = TransferTotals("receive")

    def open_channel(self, device: str, options: NodeOptions, rank: int) -> KVReceiver:
        """The data-plane channel transfers come in by (ServingNode._open_channel)."""
        self.receiver = KVReceiver(
            device,
            timeout_s=options.transfer_timeout_s,
            host_staged=options.transfer_through_host,
            rank=rank,
        )
        return self.receiver

    def post(self, announce: TransferAnnounce, tracked: Tracked | None) -> str | None:
        """Post the receives of `announce` into `tracked`'s slots (None: no request expects
        it, and it is received into scratch); returns why `tracked` fails instead, if it does."""
        reason = self._unreceivable(announce)
        if reason is not None:
            return reason
        if tracked is None:
            log.warning(
                "announcement for room %s, which expects none: its transfer is discarded",
                announce.room,
            )
            self._discard(announce)
            return None
        refused = refusal(announce, tracked, self.prefill_ranks)
        if refused is not None:
            self._discard(announce)
            return refused
        tracked.announce = announce
        req = tracked.req
        pools = receive_pools(announce, req, self.kv_pool, self.speculator)
        pools, tracked.landing = incoming_pools(self.runner, pools)
        tracked.handle = self.receiver.expect(
            announce.prefill_rank, announce.room, pools, self.metadata, tracked.meta_row
        )
        set_time(req, "receive_posted")
        return None

    def _unreceivable(self, announce: TransferAnnounce) -> str | None:
        reason, breaks_channel = unreceivable(announce, self.prefill_ranks, self.max_len)
        if breaks_channel:
            rank = announce.prefill_rank
            log.error("%s: the channel from rank %d is out of order", reason, rank)
            self.receiver.break_channel(rank, reason)
        elif reason is not None:
            log.error("%s: the announcement is dropped", reason)
        return reason

    def _discard(self, announce: TransferAnnounce) -> None:
        """Receive an announced transfer that no request takes into scratch (see
        `KVReceiver.discard`): the prefill node sends it whatever this node decides."""
        sizes, reason = scratch_sizes(
            announce, self.wire_pool, self.speculator, self.metadata.row_nbytes
        )
        if reason is not None:
            log.error("%s: the channel from rank %d is out of order", reason, announce.prefill_rank)
            # Later transfers from that rank fail at once rather than take this one's data.
            self.receiver.break_channel(announce.prefill_rank, reason)
            return
        self.receiver.discard(announce.prefill_rank, announce.room, sizes)

    def land(self, act: Callable[[Tracked, str | None], None]) -> None:
        """Hand `act` each request whose transfer ended and can be acted on, with why it cannot
        run (None: it landed, or it was aborted), and stop tracking it. Carriers first: a
        parallel sample whose transfer ended waits for its prompt's."""
        still = []
        ordered = sorted(
            self.requests, key=lambda t: t.group is not None and t.group.carrier is t, reverse=True
        )
        for tracked in ordered:
            handle = tracked.handle
            if handle is None or handle.state not in (TransferState.SUCCESS, TransferState.FAILED):
                still.append(tracked)
                continue
            if not tracked.settled():
                still.append(tracked)
                continue
            group = tracked.group
            if group is not None and not tracked.aborted and group.waits_for_prompt(tracked):
                still.append(tracked)
                continue
            self.totals.record(handle, *received_tokens(tracked.announce))
            error = None if tracked.aborted else landing_error(tracked, self.faults)
            if error is None and not tracked.aborted:
                error = self._write_landed(tracked)
            if group is not None:
                error = group.landed(tracked, error)
            act(tracked, error)
        self.requests = still

    def _write_landed(self, tracked: Tracked) -> str | None:
        """Write a staged landing into the ranks' pools, before the request is admitted; on
        the serving thread, which runs the forwards (the ranks order the two alike)."""
        landing, tracked.landing = tracked.landing, None
        if landing is None:
            return None
        try:
            landing.write(self.runner)
        except (RuntimeError, RankFailedError) as err:
            log.exception(
                "room %s: writing its landed KV to the ranks failed", tracked.req.request_id
            )
            return f"writing the landed KV to the tensor parallel ranks failed: {err}"
        return None

    def in_flight(self) -> int:
        """Transfers announced and not acted on yet."""
        return sum(1 for tracked in list(self.requests) if tracked.handle is not None)

    def unsettled_peers(self) -> set[int]:
        """The ranks of prefill nodes with a receive still posted that timed out."""
        # Called from the health probe's thread: a copy of the list the serving loop replaces.
        return {
            tracked.handle.peer
            for tracked in list(self.requests)
            if tracked.handle is not None and tracked.handle.left_posted
        }
