"""The prefill node: runs prompts, samples each request's first token, and sends the prompt's KV
and the metadata row to the decode node that reserved room for it. Its prompts run through the
engine's EngineCore, prefill only (admission, chunks, forward, sampling and the draft extend
for prefill are the engine's); what is its own is announcing and sending the transfers
(`engine.engine_hooks.PrefillHandoff`).

A request arrives only after its decode node has preallocated (decode-driven handshake), so the
prefill node announces each transfer on the control plane as soon as the request's batch is
admitted, before the forward: the decode node posts its receives while the prompt runs, and the
send finds them posted. After the forward it sends a PrefillResult (what the row does not carry,
or the error), then hands the transfer to the per-peer sender; slots are freed when it ends.

An announced transfer is always sent: the decode node's receives are posted and cannot be
cancelled. When the prefill fails after the announcement, the same messages go out under a void
row (room tag 0, `MetadataBuffers.void`), which the decode node never takes for a landed one,
and the PrefillResult carries the error, naming this node. A prompt in chunks is announced
before its last chunk: a request aborted or failed before then is abandoned (TransferAbandoned),
and its slots are freed at once.

Parallel samples of one prompt (`PrefillRequest.samples`) enter the engine together
(`EngineCore.add_samples`): the prompt is prefilled once, each sample draws its own first token
and drafts its own chain, and each has a transfer of its own; the request's (the carrier's)
carries the prompt's target KV, the samples' only their draft depths' KV and their rows
(`TransferAnnounce.prompt_room`)."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

import torch

from engine.build import build_engine
from engine.errors import RequestRejectedError
from engine.kv_pool import KVPool
from engine.loader import EngineArgs
from engine.request import Request
from engine.sampler import TokenLogprob
from engine.tracing import set_time
from metadata.control import Inbox, Outbox
from metadata.faults import PREFILL_FAULT_PHASES
from metadata.frontend_links import FrontendLinks, LoadReports
from metadata.kv_audit import PoolCount, request_pools
from metadata.messages import (
    AbortRequest,
    FrontendHello,
    PrefillRequest,
    PrefillResult,
    TransferAbandoned,
    TransferAnnounce,
)
from metadata.node_common import (
    NodeOptions,
    metadata_buffers,
    start_node_process,
)
from metadata.node_metrics import Activity, ActivityLog, TransferTotals
from metadata.pair_group import PairLink
from metadata.serving_node import ServingNode
from metadata.transfer import KVSender, TransferState
from prefill_node.admission import admit_group, pending_group
from prefill_node.pending import Pending, drafts_after_first_token
from prefill_node.transfer_contents import (
    prepare_early_kv,
    sent_and_reused,
    void_pools,
    write_transfer,
)
from spec.compose import speculation_of

log = logging.getLogger(__name__)
IDLE_POLL_MS = 5
WAITING_POLL_MS = 1


class PrefillNode(ServingNode):
    def __init__(self, args: EngineArgs, options: NodeOptions) -> None:
        super().__init__(options)
        if args.speculative_algorithm is not None:
            # A transfer carries the main draft chain only; the decode node drafts its own
            # trees from its first draft extend on.
            args = dataclasses.replace(
                args, num_draft_chains=1, speculative_topk=None, num_draft_tokens=None
            )
        start_node_process(args, options)
        built = build_engine(
            args,
            speculation_of(args),
            node_name=options.name,
            decodes=False,  # this node never decodes: it captures prefill graphs only
            transfers_kv=True,
            handoff=self,
            # Unseeded sampling differs per node on purpose; seeded requests use step_seed.
            seed=args.seed + 7919 * options.index,
        )
        self.spec, self.runner, self.engine = built.spec, built.runner, built.core
        self.speculator, self.num_draft_steps = built.speculator, built.num_draft_steps
        self.kv_cache = self.engine.kv_cache
        self.metadata = metadata_buffers(self.spec, options, self.num_draft_steps)
        self.inbox = Inbox(options.host, options.control_key)
        self.outboxes: dict[int, Outbox] = {}
        # Front ends hear this node's load (the prefill policies weigh it).
        self.frontends = FrontendLinks(options.control_key)
        self.load_reports = LoadReports(self.frontends, "prefill", options.index)
        self.sender: KVSender | None = None
        # Requests waiting for a metadata row (each with its parallel samples, which enter the
        # engine together), then those in the engine (rows held), by room.
        self.waiting: deque[list[Pending]] = deque()
        self.prefilling: dict[str, Pending] = {}
        self.sending: list[Pending] = []
        # Transfers an injected "stall" fault keeps from ever being sent (engine.env).
        self.stalled: list[Pending] = []
        self.prompts_done = 0
        self.prompt_tokens = 0
        self.transfer_totals = TransferTotals("send")
        self.activity_log = ActivityLog(options.stats_log_interval_s, log)

    # --- setup and health (Ray calls) ---
    def connect(self, decode_endpoints: dict[int, str]) -> None:
        key = self.options.control_key
        self.outboxes = {i: Outbox(e, key) for i, e in decode_endpoints.items()}

    def peer_replaced(self, index: int, endpoint: str, link: PairLink) -> None:
        """(Ray call) decode-`index` was replaced by a node at `endpoint`: send there, and open
        the new channel with it."""
        old = self.outboxes.get(index)
        # The serving thread owns the sockets: it closes the old one.
        self.outboxes[index] = Outbox(endpoint, self.options.control_key)
        if old is not None:
            self._events.put(old.close)
        self.repair(link)

    def stats(self) -> dict:
        allocator = self.runner.kv_pool.allocator
        return {
            "node": self.options.name,
            "queued": self._num_waiting() + len(self.prefilling),
            "sending": len(self.sending),
            "kv_used": self.kv_cache.num_used_slots,
            "kv_capacity": allocator.capacity,
            "prompts_done": self.prompts_done,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.engine.prefill_tokens,
            "transfers_in_flight": len(self.sending) + len(self.stalled),
            "transfers": self.transfer_totals.as_dict(),
            "control_rejected": self.inbox.rejected,
            **self._health_stats(),
        }

    def _open_channel(self) -> KVSender:
        self.sender = KVSender(
            self.spec.engine_config.device,
            timeout_s=self.options.transfer_timeout_s,
            host_staged=self.options.transfer_through_host,
            rank=self.rank,
        )
        return self.sender

    # --- the serving loop (one thread owns the engine and the sockets) ---
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._housekeeping()
                # Only transfers in flight: block briefly rather than spin, so the sender
                # threads get the interpreter.
                busy = self.waiting or self.prefilling
                timeout = 0 if busy else (WAITING_POLL_MS if self.sending else IDLE_POLL_MS)
                for msg in self.inbox.receive(timeout):
                    self._handle(msg)
                self._finish_transfers()
                self._feed()
                if self.engine.has_work():
                    self.engine.step()
                allocator = self.runner.kv_pool.allocator
                requests = self._num_waiting() + len(self.prefilling) + len(self.sending)
                self.load_reports.tick(requests, self.kv_cache.num_used_slots, allocator.capacity)
                self.activity_log.tick(self._activity)
        finally:
            self.frontends.close()

    def _activity(self) -> Activity:
        allocator = self.runner.kv_pool.allocator
        return Activity(
            None,
            self._num_waiting() + len(self.prefilling),
            len(self.sending),
            self.kv_cache.num_used_slots,
            allocator.capacity,
            self.prompt_tokens,
        )

    def _handle(self, msg: object) -> None:
        if isinstance(msg, FrontendHello):
            self.frontends.open(msg.frontend, msg.endpoint)
        elif isinstance(msg, PrefillRequest):
            self.faults.request_arrived()
            self._queue(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(str(msg.room))
        else:
            log.warning("unexpected message %s", type(msg).__name__)

    def _queue(self, msg: PrefillRequest) -> None:
        """Queue a request with the parallel samples of its prompt; refused, each of them is
        abandoned (the decode node hears of every room it asked for)."""
        num_draft_steps = self.num_draft_steps if self.speculator is not None else None
        group = pending_group(msg, self.options.enable_tracing, num_draft_steps)
        try:
            admit_group(msg, group, self.engine, self.spec.model_config.hidden_size)
        except RequestRejectedError as err:
            for member in group:
                self._abandon(member, str(err))
            return
        self.waiting.append(group)

    def _num_waiting(self) -> int:
        return sum(len(group) for group in self.waiting)

    def _abort(self, room: str) -> None:
        """Drop a request whose prompt is not done (between two chunks of it, its slots are
        freed now); an announced transfer is always sent. (A decode node aborts a prompt's
        carrier only once its samples are aborted too: they read the carrier's KV.)"""
        for group in list(self.waiting):
            for pending in [p for p in group if p.req.request_id == room]:
                group.remove(pending)
                self._abandon(pending, "aborted before prefill")
            if not group:
                self.waiting.remove(group)
        pending = self.prefilling.pop(room, None)
        if pending is not None:
            self.engine.abort(room)
            self._abandon(pending, "aborted before prefill")

    def _feed(self) -> None:
        """Hand the engine the requests that can take a metadata row (their transfer's)."""
        while self.waiting and self.metadata.num_free >= len(self.waiting[0]):
            group = self.waiting.popleft()
            for pending in group:
                pending.meta_row = self.metadata.allocate()
                self.prefilling[pending.req.request_id] = pending
            if len(group) == 1:
                self.engine.add_request(group[0].req)
            else:
                self.engine.add_samples([pending.req for pending in group])

    # --- engine_hooks.PrefillHandoff: the engine's prefill steps ---
    def prefill_completing(self, completing: list[Request]) -> None:
        """Announce before the forward that ends their prompts (a prompt in chunks, before its
        last chunk): every transfer announced is sent in the same step, so the order of the
        announcements to a decode node is the order of its sends, which NCCL matches by."""
        batch = [self.prefilling[req.request_id] for req in completing]
        for pending in batch:
            self._announce(pending)
        prepare_early_kv(batch, self.runner.kv_pool)

    def forward_enqueued(self, completing: list[Request]) -> None:
        self._begin_transfers([self.prefilling[req.request_id] for req in completing])

    def prefilled(
        self,
        requests: list[Request],
        logprobs: list[TokenLogprob | None],
        last_hidden: torch.Tensor,
    ) -> None:
        batch = [self.prefilling.pop(req.request_id) for req in requests]
        # The announcement decided before the first token existed; the rule is the engine's.
        assert all(p.drafted == (p.req.lookahead > 0) for p in batch), "drafting changed"
        # A parallel sample's prompt was prefilled for its carrier: counted once.
        prefilled = [p.req for p in batch if p.carries_prompt]
        self.prompts_done += len(prefilled)
        self.prompt_tokens += sum(len(r.prompt_token_ids) for r in prefilled)
        for i, pending in enumerate(batch):
            self._send(pending, logprobs[i], last_hidden[i])

    def failed(self, requests: list[Request], error: str) -> None:
        log.error("prefill of rooms %s failed: %s", [r.request_id for r in requests], error)
        for req in requests:
            pending = self.prefilling.pop(req.request_id)
            if pending.announced:
                self._send_void(pending, error)
            else:
                self._abandon(pending, error)

    def _announce(self, pending: Pending) -> None:
        """Tell the decode node what to receive, before the forward: whether the request drafts
        is known now (it depends on max_tokens alone), so the number of pools never changes."""
        req = pending.req
        pending.announced = True
        pending.drafted = self.speculator is not None and drafts_after_first_token(req)
        self.outboxes[pending.decode_node].send(
            TransferAnnounce(
                int(req.request_id),
                self.rank,
                len(req.prompt_token_ids),
                self.num_draft_steps if pending.drafted else 0,
                pending.prompt_room,
                pending.reused_tokens,
            )
        )
        set_time(req, "transfer_announced")

    def _begin_transfers(self, batch: list[Pending]) -> None:
        """Post the target KV of the transfers `prepare_early_kv` chose (`KVSender.begin`):
        the KV moves as soon as it exists, and posting overlaps the end of the forward."""
        for pending in batch:
            if pending.target_kv is not None:
                room = int(pending.req.request_id)
                pending.handle = self.sender.begin(pending.decode_rank, room, pending.target_kv)

    def _send(self, pending: Pending, logprob, last_hidden: torch.Tensor) -> None:
        req = pending.req
        room = int(req.request_id)
        fault = self.faults.transfer_fault(PREFILL_FAULT_PHASES)
        if fault == "before":
            self._send_void(pending, "transfer failed: injected fault before the KV send")
            return
        if fault == "stall":
            log.warning("room %s: injected fault: its transfer is never sent", room)
            self.stalled.append(pending)
            return
        try:
            pools = write_transfer(
                pending, self.runner.kv_pool, self.speculator, self.metadata, logprob, last_hidden
            )
            if fault == "during":
                # The KV goes out, but the row's room tag does not match: the decode node
                # fails the transfer when it lands.
                self.metadata.void(pending.meta_row)
        except Exception as err:  # noqa: BLE001 - fails this request only
            log.exception("room %s: preparing its transfer failed", room)
            self._send_void(pending, f"preparing the transfer failed: {type(err).__name__}: {err}")
            return
        top = [[t, lp] for t, lp in logprob.top_logprobs] if logprob else []
        # The result goes first, so that the decode node has it when the KV lands; it carries
        # this node's timeline, which the decode node reports to the router with its own.
        reused = pending.reused_tokens
        set_time(req, "transfer_start", {"kv_tokens": req.kv_len - reused, "reused_tokens": reused})
        trace = req.trace.events if req.trace is not None else []
        cached = req.cached_tokens if self.kv_cache.prefix_cache is not None else None
        self.outboxes[pending.decode_node].send(
            PrefillResult(room, top, trace, cached_tokens=cached)
        )
        self._post_send(pending, pools)

    def _send_void(self, pending: Pending, reason: str) -> None:
        """Complete an announced transfer whose request failed: the same messages, read from
        slots whose content means nothing, under a void row; the result says why."""
        req = pending.req
        room = int(req.request_id)
        error = f"{self.options.name}: {reason}"
        self.outboxes[pending.decode_node].send(PrefillResult(room, error=error))
        self.metadata.void(pending.meta_row)
        pools = void_pools(
            self.runner.kv_pool,
            self.speculator,
            len(req.prompt_token_ids),
            pending.drafted,
            pending.carries_prompt,
            pending.reused_tokens,
        )
        self._post_send(pending, pools)

    def _post_send(self, pending: Pending, pools: list[tuple[KVPool, list[int]]]) -> None:
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
            self._release(pending)
            return
        self.sending.append(pending)

    def _finish_transfers(self) -> None:
        still = []
        for pending in self.sending:
            state = pending.handle.state
            if state in (TransferState.SUCCESS, TransferState.FAILED):
                self.transfer_totals.record(pending.handle, *sent_and_reused(pending))
                if state == TransferState.FAILED:
                    log.warning(
                        "transfer of room %s failed: %s",
                        pending.req.request_id,
                        pending.handle.error,
                    )
                self._release(pending)
            else:
                still.append(pending)
        self.sending = still

    def _abandon(self, pending: Pending, reason: str) -> None:
        """Drop a request that was not announced: the decode node posts nothing for it."""
        room = int(pending.req.request_id)
        outbox = self.outboxes.get(pending.decode_node)
        if outbox is not None:
            outbox.send(TransferAbandoned(room, f"{self.options.name}: {reason}"))
        self._release(pending)

    def _release(self, pending: Pending) -> None:
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
        self._free(pending.req, pending.meta_row)
        pending.meta_row = None

    def _free(self, req: Request, meta_row: int | None) -> None:
        self.kv_cache.release(req)
        if self.speculator is not None:
            self.speculator.release(req)
        if meta_row is not None:
            self.metadata.free(meta_row)

    def _drop_frontend(self, frontend: int) -> None:
        # Its requests are aborted by their decode nodes, which tell this node.
        self.frontends.forget(frontend)

    def _drop_peer(self, index: int, rank: int, reason: str) -> None:
        """decode-`index` died: drop every request bound for it and free their slots and rows,
        sends still posted or not: a dead process reads nothing more."""
        for group in list(self.waiting):
            if group[0].decode_node == index:
                self.waiting.remove(group)
                for pending in group:
                    self._free(pending.req, pending.meta_row)
        for room, pending in list(self.prefilling.items()):
            if pending.decode_node == index:
                del self.prefilling[room]
                self.engine.abort(room)
                self._free(pending.req, pending.meta_row)
        for group in (self.sending, self.stalled):
            for pending in [p for p in group if p.decode_node == index]:
                group.remove(pending)
                self._free(pending.req, pending.meta_row)
                pending.meta_row = None
        for held in self.quarantine.release_peer(rank):
            self._free(held.req, held.meta_row)
        log.warning("%s: requests and slots bound for decode-%d let go", reason, index)

    def _pool_counts(self) -> list[PoolCount]:
        waiting = [pending for group in self.waiting for pending in group]
        pendings = [*waiting, *self.prefilling.values(), *self.sending, *self.stalled]
        held = self.quarantine.requests()
        requests = [p.req for p in pendings] + [h.req for h in held]
        rows_held = sum(1 for p in pendings if p.meta_row is not None)
        rows_held += sum(1 for h in held if h.meta_row is not None)
        return request_pools(
            self.runner.kv_pool.allocator.num_used,
            requests,
            self.speculator,
            (self.metadata.num_rows - self.metadata.num_free, rows_held),
            cached=self.kv_cache.cached_slots(),
        )
