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
from engine.tracing import set_time
from metadata.buffers import MetadataBuffers
from metadata.faults import FaultInjector
from metadata.messages import TransferAnnounce
from metadata.node_common import NodeOptions
from metadata.node_metrics import TransferTotals
from metadata.rank_kv import RankKV, incoming_pools
from metadata.transfer import KVReceiver, TransferState
from spec import MultiLayerEagleWorker

log = logging.getLogger(__name__)


class IncomingTransfers:
    def __init__(
        self,
        rank_kv: RankKV,
        speculator: MultiLayerEagleWorker | None,
        metadata: MetadataBuffers,
        faults: FaultInjector,
    ) -> None:
        # Which of this node's ranks take which KV heads from each prefill node's ranks
        # (metadata.rank_kv): rank 0's first ones come with the transfer, in its pool.
        self.rank_kv = rank_kv
        self.kv_pool = rank_kv.runner.kv_pool
        self.speculator = speculator
        self.metadata = metadata
        self.max_len = rank_kv.runner.config.max_model_len
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
        peer, room = announce.prefill_rank, announce.room
        pools, landing = incoming_pools(self.rank_kv, peer, room, pools)
        tracked.handle = self.receiver.expect(peer, room, pools, self.metadata, tracked.meta_row)
        set_time(req, "receive_posted")
        if landing is None:
            return None
        try:
            landing.expect(self.rank_kv)
        except (RuntimeError, RankFailedError) as err:  # a rank is gone: the node fails
            log.exception("room %s: posting its ranks' receives failed", room)
            return f"posting the tensor parallel ranks' receives failed: {err}"
        tracked.landing = landing
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
        peer = announce.prefill_rank
        # The target KV's message holds the heads the node channel carries (metadata.rank_kv).
        wire_pool = self.rank_kv.node_pool(peer, 1)
        sizes, reason = scratch_sizes(
            announce, wire_pool, self.speculator, self.metadata.row_nbytes
        )
        if reason is not None:
            log.error("%s: the channel from rank %d is out of order", reason, peer)
            # Later transfers from that rank fail at once rather than take this one's data.
            self.receiver.break_channel(peer, reason)
            return
        self.receiver.discard(peer, announce.room, sizes)
        if announce.prompt_room != 0:
            return
        # The other ranks' heads come too: received, and dropped as they land.
        try:
            self.rank_kv.expect(peer, announce.room, announce.num_tokens - announce.reused_tokens)
            self.rank_kv.land(peer, announce.room, None)
        except (RuntimeError, RankFailedError):  # a rank is gone: the node fails
            log.exception("room %s: posting its ranks' receives failed", announce.room)

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
            if tracked.aborted:
                error = self._land_aborted(tracked)
            else:
                error = landing_error(tracked, self.faults)
                if error is None:
                    error = self._write_landed(tracked)
                else:
                    self.drop(tracked)
            if group is not None:
                error = group.landed(tracked, error)
            act(tracked, error)
        self.requests = still

    def _land_aborted(self, tracked: Tracked) -> str | None:
        """The transfer of `tracked`, aborted, ended: its KV heads are dropped, but where it
        carries its prompt's KV for other samples (decode_node.samples), which landed: then
        every rank writes its heads as for a request that runs, since the samples read them.
        Returns why that prompt did not land (None: it did, or `tracked` carries none)."""
        group = tracked.group
        if group is None or group.carrier is not tracked:
            self.drop(tracked)
            return None
        handle = tracked.handle
        if handle.state != TransferState.SUCCESS:
            self.drop(tracked)
            return f"KV transfer failed: {handle.error}"
        return self._write_landed(tracked)

    def _write_landed(self, tracked: Tracked) -> str | None:
        """Write what landed beyond rank 0's pool into the ranks' pools, before the request
        is admitted; on the serving thread, which runs the forwards (the ranks order the two
        alike). KV heads that did not land leave their links out of order: the channel with
        their prefill node is reported broken, so that the node is replaced (and the links
        re-made)."""
        landing, tracked.landing = tracked.landing, None
        if landing is None:
            return None
        try:
            error = landing.write(self.rank_kv)
        except (RuntimeError, RankFailedError) as err:
            log.exception(
                "room %s: writing its landed KV to the ranks failed", tracked.req.request_id
            )
            return f"writing the landed KV to the tensor parallel ranks failed: {err}"
        if error is None:
            return None
        log.error("room %s: %s", tracked.req.request_id, error)
        self.receiver.break_channel(landing.peer, f"KV heads through the ranks' links: {error}")
        return f"KV transfer from prefill-{tracked.message.prefill_node} failed: {error}"

    def remove(self, tracked: Tracked) -> None:
        """Stop tracking `tracked`, whose transfer ended, without acting on it."""
        self.requests.remove(tracked)
        self.drop(tracked)

    def drop(self, tracked: Tracked) -> None:
        """`tracked` will not run: its ranks drop the KV heads of its transfer as they land."""
        landing, tracked.landing = tracked.landing, None
        if landing is None:
            return
        try:
            landing.drop(self.rank_kv)
        except (RuntimeError, RankFailedError):
            log.exception("room %s: dropping its KV heads failed", tracked.req.request_id)

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
