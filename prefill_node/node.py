"""The prefill node: runs prompts, samples each request's first token, and sends the prompt's KV
and the metadata row to the decode node that reserved room for it. Its prompts run through the
engine's EngineCore, prefill only (admission, chunks, forward, sampling and the draft extend
for prefill are the engine's); what is its own is announcing and sending the transfers
(`engine.engine_hooks.PrefillHandoff`).

A request arrives only after its decode node has preallocated (decode-driven handshake), so the
prefill node announces each transfer on the control plane as soon as the request's batch is
admitted, before the forward: the decode node posts its receives while the prompt runs, and the
send finds them posted. After the forward it sends a PrefillResult (what the row does not carry,
or the error), then hands the transfer to the per-peer sender; slots are freed when it ends
(prefill_node.outgoing). A decode node that holds a prompt's first positions already
(PrefillRequest.reused_tokens, decode_node.reuse) gets the KV of the rest only.

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
from engine.loading.loader import EngineArgs
from engine.request import Request
from engine.sampling.sampler import TokenLogprob
from metadata.control import Inbox, Outbox
from metadata.frontend_links import FrontendLinks, LoadReports
from metadata.kv_audit import PoolCount, request_pools
from metadata.messages import (
    AbortRequest,
    FrontendHello,
    PrefillRequest,
)
from metadata.node_common import (
    NodeOptions,
    metadata_buffers,
    start_node_process,
)
from metadata.node_metrics import Activity, ActivityLog
from metadata.pair_group import PairLink
from metadata.rank_kv import RankKV
from metadata.serving_node import ServingNode, poll_timeout_ms
from metadata.transfer import KVSender
from prefill_node.admission import admit_group, pending_group
from prefill_node.outgoing import OutgoingTransfers
from prefill_node.pending import Pending
from prefill_node.transfer_contents import (
    prepare_early_kv,
)
from spec.compose import speculation_of

log = logging.getLogger(__name__)


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
            handoff=self,
            # Unseeded sampling differs per node on purpose; seeded requests use step_seed.
            seed=args.seed + 7919 * options.index,
        )
        self.spec, self.runner, self.engine = built.spec, built.runner, built.core
        self.speculator, self.num_draft_steps = built.speculator, built.num_draft_steps
        self.kv_cache = self.engine.kv_cache
        self.metadata = metadata_buffers(self.spec, options, self.num_draft_steps)
        self.inbox = Inbox(options.host, options.control_key)
        self.rank_kv = RankKV.of(
            self.runner, self.spec, True, options.transfer_timeout_s, options.name
        )
        self.outgoing = OutgoingTransfers(
            options.name,
            self.rank_kv,
            self.kv_cache,
            self.speculator,
            self.num_draft_steps,
            self.metadata,
            self.faults,
            self.quarantine,
        )
        # Front ends hear this node's load (the prefill policies weigh it).
        self.frontends = FrontendLinks(options.control_key)
        self.load_reports = LoadReports(self.frontends, "prefill", options.index)
        # Requests waiting for a metadata row (each with its parallel samples, which enter the
        # engine together), then those in the engine (rows held), by room.
        self.waiting: deque[list[Pending]] = deque()
        self.prefilling: dict[str, Pending] = {}
        self.prompts_done = 0
        self.prompt_tokens = 0
        self.activity_log = ActivityLog(options.stats_log_interval_s, log)

    # --- setup and health (Ray calls) ---
    def connect(self, decode_endpoints: dict[int, str]) -> None:
        key = self.options.control_key
        self.outgoing.outboxes = {i: Outbox(e, key) for i, e in decode_endpoints.items()}

    def peer_replaced(self, index: int, endpoint: str, link: PairLink) -> None:
        """(Ray call) decode-`index` was replaced by a node at `endpoint`: send there, and open
        the new channel with it (and its ranks' KV links)."""
        outboxes = self.outgoing.outboxes
        old = outboxes.get(index)
        # The serving thread owns the sockets: it closes the old one.
        outboxes[index] = Outbox(endpoint, self.options.control_key)
        if old is not None:
            self._events.put(old.close)
        self.repair(link)

    def _serving_error(self) -> str | None:
        # A lost tensor parallel rank fails the whole node, which the supervisor replaces.
        return self.runner.lost_rank()

    def stats(self) -> dict:
        allocator = self.runner.kv_pool.allocator
        return {
            "rank_kv": self.rank_kv.stats(),
            "node": self.options.name,
            "queued": self._num_waiting() + len(self.prefilling),
            "sending": len(self.outgoing.sending),
            "kv_used": self.kv_cache.num_used_slots,
            "kv_capacity": allocator.capacity,
            "prompts_done": self.prompts_done,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.engine.prefill_tokens,
            "transfers_in_flight": len(self.outgoing.pendings()),
            "transfers": self.outgoing.totals.as_dict(),
            "control_rejected": self.inbox.rejected,
            **self._health_stats(),
            **self._loop_stats(self.engine),
        }

    def _open_channel(self) -> KVSender:
        return self.outgoing.open_channel(self.spec.engine_config.device, self.options, self.rank)

    # --- the serving loop (one thread owns the engine and the sockets) ---
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._housekeeping()
                busy = bool(self.waiting or self.prefilling)
                for msg in self._receive(poll_timeout_ms(busy, bool(self.outgoing.sending))):
                    self._handle(msg)
                self.outgoing.finish()
                self._feed()
                self.loop_clock.lap("other")
                if self.engine.has_work():
                    self.engine.step()
                self.loop_clock.lap("engine")
                allocator = self.runner.kv_pool.allocator
                requests = self._num_waiting() + len(self.prefilling) + len(self.outgoing.sending)
                self.load_reports.tick(requests, self.kv_cache.num_used_slots, allocator.capacity)
                self.activity_log.tick(self._activity)
        finally:
            self.frontends.close()

    def _activity(self) -> Activity:
        allocator = self.runner.kv_pool.allocator
        return Activity(
            None,
            self._num_waiting() + len(self.prefilling),
            len(self.outgoing.sending),
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
                self.outgoing.abandon(member, str(err))
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
                self.outgoing.abandon(pending, "aborted before prefill")
            if not group:
                self.waiting.remove(group)
        pending = self.prefilling.pop(room, None)
        if pending is not None:
            self.engine.abort(room)
            self.outgoing.abandon(pending, "aborted before prefill")

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
            self.outgoing.announce(pending, self.rank)
        pool = self.runner.kv_pool
        # Where the node channel carries only some of rank 0's KV heads (metadata.rank_kv),
        # they are staged after the forward, with the rest of the transfer.
        whole = [p for p in batch if self.rank_kv.node_heads(p.decode_rank) == pool.num_kv_heads]
        prepare_early_kv(whole, pool)

    def forward_enqueued(self, completing: list[Request]) -> None:
        self.outgoing.begin([self.prefilling[req.request_id] for req in completing])

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
            self.outgoing.send(pending, logprobs[i], last_hidden[i])

    def failed(self, requests: list[Request], error: str) -> None:
        log.error("prefill of rooms %s failed: %s", [r.request_id for r in requests], error)
        for req in requests:
            pending = self.prefilling.pop(req.request_id)
            if pending.announced:
                self.outgoing.send_void(pending, error)
            else:
                self.outgoing.abandon(pending, error)

    def _finish_transfers(self) -> None:
        self.outgoing.finish()

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
                    self.outgoing.free(pending.req, pending.meta_row)
        for room, pending in list(self.prefilling.items()):
            if pending.decode_node == index:
                del self.prefilling[room]
                self.engine.abort(room)
                self.outgoing.free(pending.req, pending.meta_row)
        self.outgoing.drop_peer(index)
        for held in self.quarantine.release_peer(rank):
            self.outgoing.free(held.req, held.meta_row)
        log.warning("%s: requests and slots bound for decode-%d let go", reason, index)

    def _pool_counts(self) -> list[PoolCount]:
        waiting = [pending for group in self.waiting for pending in group]
        pendings = [*waiting, *self.prefilling.values(), *self.outgoing.pendings()]
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
