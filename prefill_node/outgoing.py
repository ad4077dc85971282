"""A prefill node's transfers: each announced to its decode node before the forward that ends
its prompt, sent after it (the PrefillResult first, then the KV and the metadata row, or a
void transfer under a failed request's row), and its slots and row let go once it ends, or
held while a send that timed out may still read them.

An announced transfer is always sent: the decode node's receives are posted and cannot be
cancelled. A request dropped before its announcement is abandoned (TransferAbandoned)."""

from __future__ import annotations

import logging

import torch

from engine.errors import RankFailedError
from engine.request import Request
from engine.sampling.sampler import TokenLogprob
from engine.scheduling.kv_cache import KVCacheManager
from engine.scheduling.kv_pool import KVPool
from engine.tracing import set_time
from metadata.buffers import MetadataBuffers
from metadata.control import Outbox
from metadata.faults import PREFILL_FAULT_PHASES, FaultInjector
from metadata.kv_audit import Quarantine
from metadata.messages import PrefillResult, TransferAbandoned, TransferAnnounce
from metadata.node_common import NodeOptions
from metadata.node_metrics import TransferTotals
from metadata.rank_kv import RankKV, outgoing_pools
from metadata.transfer import KVSender, TransferState
from prefill_node.pending import Pending, drafts_after_first_token
from prefill_node.transfer_contents import sent_and_reused, void_pools, write_transfer
from spec import MultiLayerEagleWorker

log = logging.getLogger(__name__)


class OutgoingTransfers:
    def __init__(
        self,
        node_name: str,
        rank_kv: RankKV,
        kv_cache: KVCacheManager,
        speculator: MultiLayerEagleWorker | None,
        num_draft_steps: int,
        metadata: MetadataBuffers,
        faults: FaultInjector,
        quarantine: Quarantine,
    ) -> None:
        self.node_name = node_name
        # Which ranks send which KV heads to each decode node (metadata.rank_kv).
        self.rank_kv = rank_kv
        self.kv_cache = kv_cache
        self.speculator = speculator
        self.num_draft_steps = num_draft_steps
        self.metadata = metadata
        self.faults = faults
        self.quarantine = quarantine
        self.outboxes: dict[int, Outbox] = {}  # decode node index -> its control-plane inbox
        self.sender: KVSender | None = None  # the data-plane channel, once opened
        self.sending: list[Pending] = []
        # Transfers an injected "stall" fault keeps from ever being sent (engine.env).
        self.stalled: list[Pending] = []
        self.totals = TransferTotals("send")

    def open_channel(self, device: str, options: NodeOptions, rank: int) -> KVSender:
        """The data-plane channel transfers go out by (ServingNode._open_channel)."""
        self.sender = KVSender(
            device,
            timeout_s=options.transfer_timeout_s,
            host_staged=options.transfer_through_host,
            rank=rank,
        )
        return self.sender

    def announce(self, pending: Pending, rank: int) -> None:
        """Tell the decode node what to receive, before the forward: whether the request drafts
        is known now (it depends on max_tokens alone), so the number of pools never changes."""
        req = pending.req
        pending.announced = True
        pending.drafted = self.speculator is not None and drafts_after_first_token(req)
        self.outboxes[pending.decode_node].send(
            TransferAnnounce(
                int(req.request_id),
                rank,
                len(req.prompt_token_ids),
                self.num_draft_steps if pending.drafted else 0,
                pending.prompt_room,
                pending.reused_tokens,
            )
        )
        set_time(req, "transfer_announced")

    def begin(self, batch: list[Pending]) -> None:
        """Post the target KV of the transfers `prepare_early_kv` chose (`KVSender.begin`):
        the KV moves as soon as it exists, and posting overlaps the end of the forward."""
        for pending in batch:
            if pending.target_kv is not None:
                room = int(pending.req.request_id)
                pending.handle = self.sender.begin(pending.decode_rank, room, pending.target_kv)

    def send(
        self, pending: Pending, logprob: TokenLogprob | None, last_hidden: torch.Tensor
    ) -> None:
        """Send the announced transfer of `pending`, whose prompt is done."""
        req = pending.req
        room = int(req.request_id)
        fault = self.faults.transfer_fault(PREFILL_FAULT_PHASES)
        if fault == "before":
            self.send_void(pending, "transfer failed: injected fault before the KV send")
            return
        if fault == "stall":
            log.warning("room %s: injected fault: its transfer is never sent", room)
            self.stalled.append(pending)
            return
        try:
            pools = write_transfer(
                pending, self.kv_cache.kv_pool, self.speculator, self.metadata, logprob, last_hidden
            )
            pools, target = outgoing_pools(self.rank_kv, pending.decode_rank, pools)
            if fault == "during":
                # The KV goes out, but the row's room tag does not match: the decode node
                # fails the transfer when it lands.
                self.metadata.void(pending.meta_row)
        except Exception as err:  # noqa: BLE001 - fails this request only
            log.exception("room %s: preparing its transfer failed", room)
            self.send_void(pending, f"preparing the transfer failed: {type(err).__name__}: {err}")
            return
        top = [[t, lp] for t, lp in logprob.top_logprobs] if logprob else []
        # The result goes first, so that the decode node has it when the KV lands; it carries
        # this node's timeline, which the decode node reports to the router with its own.
        sent, reused = sent_and_reused(pending)
        set_time(req, "transfer_start", {"kv_tokens": sent, "reused_tokens": reused})
        trace = req.trace.events if req.trace is not None else []
        cached = req.cached_tokens if self.kv_cache.prefix_cache is not None else None
        self.outboxes[pending.decode_node].send(
            PrefillResult(room, top, trace, cached_tokens=cached)
        )
        self._send_rank_kv(pending, target, read=True)
        self._post(pending, pools)

    def send_void(self, pending: Pending, reason: str) -> None:
        """Complete an announced transfer whose request failed: the same messages, read from
        slots whose content means nothing, under a void row; the result says why."""
        req = pending.req
        room = int(req.request_id)
        error = f"{self.node_name}: {reason}"
        self.outboxes[pending.decode_node].send(PrefillResult(room, error=error))
        self.metadata.void(pending.meta_row)
        pools = void_pools(
            self.kv_cache.kv_pool,
            self.speculator,
            len(req.prompt_token_ids),
            pending.drafted,
            pending.carries_prompt,
            pending.reused_tokens,
        )
        pools, target = outgoing_pools(self.rank_kv, pending.decode_rank, pools, read=False)
        self._send_rank_kv(pending, target, read=False)
        self._post(pending, pools)

    def _send_rank_kv(self, pending: Pending, target: list[int] | None, read: bool) -> None:
        """Have every rank send its KV heads at the target's slots to the decode ranks that
        take them from it (`read=False`: zeros of their size, for a void transfer)."""
        if target is None:
            return
        room = int(pending.req.request_id)
        try:
            slots = target if read else None
            self.rank_kv.send(pending.decode_rank, room, slots, len(target))
        except (RuntimeError, RankFailedError):
            # A rank is gone, which fails this node; the decode node's wait for those heads
            # fails the request.
            log.exception("room %s: its ranks could not send their KV heads", room)

    def _post(self, pending: Pending, pools: list[tuple[KVPool, list[int]]]) -> None:
        room = int(pending.req.request_id)
        try:
            pending.handle = self.sender.send(
                pending.decode_rank,
                room,
                pools,
                self.metadata,
                pending.meta_row,
                begun=pending.handle,
            )
        except Exception:  # noqa: BLE001 - the channel or the sender is gone, not the node
            # The decode node's receive stays posted until its deadline breaks the channel.
            log.exception("room %s: its announced transfer could not be sent", room)
            self.release(pending)
            return
        self.sending.append(pending)

    def finish(self) -> None:
        """Count and let go of the transfers that ended."""
        still = []
        for pending in self.sending:
            state = pending.handle.state
            if state in (TransferState.SUCCESS, TransferState.FAILED):
                self.totals.record(pending.handle, *sent_and_reused(pending))
                if state == TransferState.FAILED:
                    log.warning(
                        "transfer of room %s failed: %s",
                        pending.req.request_id,
                        pending.handle.error,
                    )
                self.release(pending)
            else:
                still.append(pending)
        self.sending = still

    def abandon(self, pending: Pending, reason: str) -> None:
        """Drop a request that was not announced: the decode node posts nothing for it."""
        room = int(pending.req.request_id)
        outbox = self.outboxes.get(pending.decode_node)
        if outbox is not None:
            outbox.send(TransferAbandoned(room, f"{self.node_name}: {reason}"))
        self.release(pending)

    def release(self, pending: Pending) -> None:
        if pending.handle is not None and pending.handle.may_still_read:
            # Its sends stay posted (a timeout cannot cancel them) and read the slots and the
            # row in place whenever the peer receives: reused, they would send another
            # request's KV under this room's tag. Held until the decode node is replaced (or
            # this node is: a broken channel replaces its prefill end).
            self.quarantine.hold(
                pending.req,
                int(pending.req.request_id),
                pending.decode_rank,
                f"a send of its transfer is still posted: {pending.handle.error}",
                meta_row=pending.meta_row,
            )
            pending.meta_row = None
            return
        self.free(pending.req, pending.meta_row)
        pending.meta_row = None

    def free(self, req: Request, meta_row: int | None) -> None:
        self.kv_cache.release(req)
        if self.speculator is not None:
            self.speculator.release(req)
        if meta_row is not None:
            self.metadata.free(meta_row)

    def drop_peer(self, index: int) -> None:
        """decode-`index` died: free what its transfers hold, sends still posted or not."""
        for group in (self.sending, self.stalled):
            for pending in [p for p in group if p.decode_node == index]:
                group.remove(pending)
                self.free(pending.req, pending.meta_row)
                pending.meta_row = None

    def pendings(self) -> list[Pending]:
        """The requests whose transfer is in flight, or stalled by a fault."""
        return [*self.sending, *self.stalled]
