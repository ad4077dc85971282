"""The decode node: preallocates for each request, asks a prefill node to run it, receives the
prompt's KV and metadata row, then generates and streams tokens to the router.

Life of a request here: GenerateRequest -> prealloc queue (waits while KV or metadata rows are
short: backpressure) -> slots for the prompt and the first decode step taken (`first_step_slots`)
-> PrefillRequest sent -> TransferAnnounce (sent when the prefill batch is admitted) -> receive
posted in announcement order, while the prefill runs -> PrefillResult (the first token's top
logprobs and the prefill timeline, or the prefill's error) -> landed (room tag checked) -> first
token streamed, request joins the running batch -> decode steps, its KV (the target's and each
draft depth's) growing step by step -> finished, slots freed. A transfer is settled once it
ended and its PrefillResult came (both normally come together: the result is sent before the
KV); a result that reports an error fails the request at once, and its slots are freed when the
(void) transfer ends.

When the pool runs short mid-decode, the engine's scheduler retracts running requests (the rule
is engine.scheduler.retraction_victim's): a retracted request waits in the engine's queue, ahead
of new preallocations, and runs again here as a prefill of prompt + output so far (this node
holds the full model), its draft state rebuilt by the draft extend for prefill, its output
unchanged.

Parallel samples of one prompt (`GenerateRequest.samples`) share one prefill and one transfer
of the prompt's KV, in forked slots (decode_node.samples)."""

from __future__ import annotations

import logging
import time
from collections import deque

from decode_node.admission import admitted_requests, prefill_request
from decode_node.announcements import refusal, unreceivable
from decode_node.prealloc import fits, preallocate
from decode_node.receives import adopt_landed, landing_error, receive_pools, scratch_sizes
from decode_node.reuse import hold_prefix, let_go_prefix, received_tokens
from decode_node.samples import (
    SampleGroup,
    sample_messages,
)
from decode_node.token_streams import TokenStreams, decode_final_stats, stream_sink
from decode_node.tracked import Tracked
from engine.build import build_engine
from engine.errors import RequestRejectedError
from engine.loader import EngineArgs
from engine.tracing import set_time, set_time_batch
from metadata.control import Inbox, Outbox
from metadata.frontend_links import FrontendLinks, LoadReports
from metadata.handshake import PairingError, TransferSpec, check_compatible
from metadata.kv_audit import PoolCount, request_pools
from metadata.messages import (
    AbortRequest,
    FrontendHello,
    GenerateRequest,
    PrefillResult,
    TransferAbandoned,
    TransferAnnounce,
)
from metadata.node_common import (
    NodeOptions,
    metadata_buffers,
    start_node_process,
    transfer_spec,
)
from metadata.node_metrics import Activity, ActivityLog, SpeculationTotals, TransferTotals
from metadata.pair_group import PairLink
from metadata.serving_node import ServingNode
from metadata.transfer import KVReceiver, TransferState
from spec.compose import speculation_of

log = logging.getLogger(__name__)
IDLE_POLL_MS = 5
WAITING_POLL_MS = 1


class DecodeNode(ServingNode):
    def __init__(self, args: EngineArgs, options: NodeOptions) -> None:
        super().__init__(options)
        start_node_process(args, options)
        built = build_engine(
            args,
            speculation_of(args),
            node_name=options.name,
            transfers_kv=True,
            tracing=options.enable_tracing,
            # Finished requests' KV stays, for the next turns of their conversations.
            prefix_cache=options.decode_reuse,
        )
        self.spec, self.engine = built.spec, built.core
        self.speculator, self.num_draft_steps = built.speculator, built.num_draft_steps
        self.kv_cache = self.engine.kv_cache
        self.metadata = metadata_buffers(self.spec, options, self.num_draft_steps)
        self.spec_totals = SpeculationTotals()
        self.inbox = Inbox(options.host, options.control_key)
        self.prefill_outboxes: dict[int, Outbox] = {}
        self.prefill_ranks: dict[int, int] = {}  # prefill node index -> its data-plane rank
        self.frontends = FrontendLinks(options.control_key)
        self.streams = TokenStreams(
            stream_sink(self.spec, options, self.frontends), options.name, options.stream_interval
        )
        self.load_reports = LoadReports(self.frontends, "decode", options.index)
        self.receiver: KVReceiver | None = None
        self.rooms: dict[int, Tracked] = {}
        self.prealloc: deque[Tracked] = deque()
        self.receiving: list[Tracked] = []
        self.transfer_totals = TransferTotals("receive")
        self.activity_log = ActivityLog(options.stats_log_interval_s, log)

    # --- setup and health (Ray calls) ---
    def connect(
        self,
        prefill_endpoints: dict[int, str],
        prefill_specs: dict[int, dict],
        prefill_ranks: dict[int, int],
    ) -> None:
        """Pair with every prefill node, refusing (PairingError) any whose KV layout, dtype,
        model or spec_hidden_size differs from this node's. `prefill_ranks`: each prefill
        node's rank in the data-plane group, the only rank its transfers may come from."""
        mine = transfer_spec(self.spec, self.num_draft_steps)
        for index in sorted(prefill_specs):
            try:
                check_compatible(TransferSpec.from_dict(prefill_specs[index]), mine)
            except PairingError as err:
                raise PairingError(f"prefill-{index} and {self.options.name}: {err}") from None
        key = self.options.control_key
        self.prefill_outboxes = {i: Outbox(e, key) for i, e in prefill_endpoints.items()}
        self.prefill_ranks = dict(prefill_ranks)

    def peer_replaced(self, index: int, endpoint: str, spec: dict, link: PairLink) -> None:
        """(Ray call) prefill-`index` was replaced by a node at `endpoint`: check that it can
        pair, send its requests there, and open the new channel with it."""
        mine = transfer_spec(self.spec, self.num_draft_steps)
        try:
            check_compatible(TransferSpec.from_dict(spec), mine)
        except PairingError as err:
            raise PairingError(f"prefill-{index} and {self.options.name}: {err}") from None
        old = self.prefill_outboxes.get(index)
        # Swapped here, before the router routes to the new node; the serving thread, which
        # owns the sockets, closes the old one.
        self.prefill_outboxes[index] = Outbox(endpoint, self.options.control_key)
        if old is not None:
            self._events.put(old.close)
        self.repair(link)

    def stats(self) -> dict:
        allocator = self.engine.runner.kv_pool.allocator
        return {
            "node": self.options.name,
            "running": len(self.engine.scheduler.running),
            "queued": self._num_waiting_for_kv(),
            "retractions": self.engine.scheduler.num_retractions,
            "receiving": len(self.receiving),
            "kv_used": self.kv_cache.num_used_slots,
            "kv_capacity": allocator.capacity,
            "tokens_out": self.streams.tokens_out,
            "prefill_tokens": self.engine.prefill_tokens,
            **self.kv_cache.prefix_cache_stats(),
            **self.spec_totals.stats(),
            "spec_plans": self.engine.plan_counts(),
            "transfers_in_flight": self._transfers_in_flight(),
            "transfers": self.transfer_totals.as_dict(),
            "control_rejected": self.inbox.rejected,
            **self._health_stats(),
        }

    def _num_waiting_for_kv(self) -> int:
        """New requests waiting to preallocate, and retracted ones waiting to run again."""
        return len(self.prealloc) + len(self.engine.scheduler.waiting)

    def _transfers_in_flight(self) -> int:
        return sum(1 for tracked in list(self.receiving) if tracked.handle is not None)

    def _open_channel(self) -> KVReceiver:
        self.receiver = KVReceiver(
            self.spec.engine_config.device,
            timeout_s=self.options.transfer_timeout_s,
            host_staged=self.options.transfer_through_host,
            rank=self.rank,
        )
        return self.receiver

    # --- the serving loop ---
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._housekeeping()
                for msg in self.inbox.receive(self._poll_timeout_ms()):
                    self._handle(msg)
                self._preallocate()
                self._land_transfers()
                if self.engine.has_work():
                    self._step()
                self.streams.flush()
                self._report_load()
                self.activity_log.tick(self._activity)
        finally:
            self.frontends.close()

    def _report_load(self) -> None:
        capacity = self.engine.runner.kv_pool.allocator.capacity
        self.load_reports.tick(len(self.rooms), self.kv_cache.num_used_slots, capacity)

    def _activity(self) -> Activity:
        allocator = self.engine.runner.kv_pool.allocator
        running = self.engine.scheduler.running
        return Activity(
            len(running),
            self._num_waiting_for_kv(),
            self._transfers_in_flight(),
            self.kv_cache.num_used_slots,
            allocator.capacity,
            self.streams.tokens_out,
            *self.spec_totals.with_running(running),
        )

    def _poll_timeout_ms(self) -> int:
        if self.engine.scheduler.running:
            return 0
        # Waiting on transfers only: block briefly rather than spin, so the receiver threads
        # get the interpreter.
        waiting = self.receiving or self.prealloc or self.engine.scheduler.waiting
        return WAITING_POLL_MS if waiting else IDLE_POLL_MS

    def _handle(self, msg: object) -> None:
        if isinstance(msg, FrontendHello):
            self.frontends.open(msg.frontend, msg.endpoint)
            self.streams.hello(msg)
        elif isinstance(msg, GenerateRequest):
            self.faults.request_arrived()
            self._accept(msg)
        elif isinstance(msg, TransferAnnounce):
            self._post_receive(msg)
        elif isinstance(msg, PrefillResult):
            self._take_result(msg)
        elif isinstance(msg, TransferAbandoned):
            tracked = self.rooms.get(msg.room)
            if tracked is not None:
                self._fail(tracked, msg.reason)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.room)
        else:
            log.warning("unexpected message %s", type(msg).__name__)

    def _accept(self, msg: GenerateRequest) -> None:
        messages = sample_messages(msg) if msg.samples else [msg]
        max_shared = min(self.metadata.num_rows, self.engine.kv_cache.max_requests)
        try:
            requests = admitted_requests(msg, messages, self.engine, max_shared)
        except (RequestRejectedError, ValueError) as err:
            for m in messages:
                self.streams.fail(msg.frontend, m.room, f"{self.options.name}: {err}")
            return
        members = []
        for req, m in zip(requests, messages):
            set_time(req, "decode_received")
            stream = self.streams.open(msg.frontend, m.room, req.params.stop_strings)
            members.append(Tracked(req, m, stream))
            self.rooms[m.room] = members[-1]
        if len(members) > 1:
            SampleGroup(members)
        self.prealloc.append(members[0])

    def _preallocate(self) -> None:
        scheduler = self.engine.scheduler
        while self.prealloc:
            if scheduler.waiting:
                # Retracted requests run again first: new ones must not keep them out.
                return
            tracked = self.prealloc[0]
            members = tracked.group.members if tracked.group is not None else [tracked]
            requests = [member.req for member in members]
            tracked.reused_tokens = hold_prefix(requests, self.engine)
            if not fits(requests, self.engine, self.metadata):
                let_go_prefix(requests, self.engine)
                return
            self.prealloc.popleft()
            rows = preallocate(requests, self.engine, self.metadata)
            for member, row in zip(members, rows):
                member.meta_row = row
            if tracked.group is not None:
                tracked.group.carrier = tracked
            message = prefill_request(
                tracked.message, members[1:], self.options.index, self.rank, tracked.reused_tokens
            )
            self.prefill_outboxes[tracked.message.prefill_node].send(message)
            for member in members:
                set_time(member.req, "prefill_requested")  # the prefill node may run it
                self.receiving.append(member)

    def _post_receive(self, announce: TransferAnnounce) -> None:
        tracked = self.rooms.get(announce.room)
        if tracked is not None and tracked.meta_row is None:
            tracked = None  # not asked of a prefill node yet, or already running
        unreceivable = self._unreceivable(announce)
        if unreceivable is not None:
            if tracked is not None:
                self._fail(tracked, unreceivable)
            return
        if tracked is None:
            log.warning(
                "announcement for room %s, which expects none: its transfer is discarded",
                announce.room,
            )
            self._discard(announce)
            return
        refused = refusal(announce, tracked, self.prefill_ranks)
        if refused is not None:
            self._discard(announce)
            self._fail(tracked, refused)
            return
        tracked.announce = announce
        req = tracked.req
        pools = receive_pools(announce, req, self.engine.runner.kv_pool, self.speculator)
        tracked.handle = self.receiver.expect(
            announce.prefill_rank, announce.room, pools, self.metadata, tracked.meta_row
        )
        set_time(req, "receive_posted")

    def _unreceivable(self, announce: TransferAnnounce) -> str | None:
        reason, breaks_channel = unreceivable(
            announce, self.prefill_ranks, self.spec.engine_config.max_model_len
        )
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
            announce, self.engine.runner.kv_pool, self.speculator, self.metadata.row_nbytes
        )
        if reason is not None:
            log.error("%s: the channel from rank %d is out of order", reason, announce.prefill_rank)
            # Later transfers from that rank fail at once rather than take this one's data.
            self.receiver.break_channel(announce.prefill_rank, reason)
            return
        self.receiver.discard(announce.prefill_rank, announce.room, sizes)

    def _take_result(self, result: PrefillResult) -> None:
        tracked = self.rooms.get(result.room)
        if tracked is None:
            return
        tracked.result, tracked.result_at = result, time.perf_counter()
        if result.error is not None:
            # The transfer still comes (void): its slots are freed when it ends.
            self._fail(tracked, result.error)

    def _unsettled_peers(self) -> set[int]:
        # Called from the health probe's thread: a copy of the list the serving loop replaces.
        return {
            tracked.handle.peer
            for tracked in list(self.receiving)
            if tracked.handle is not None and tracked.handle.left_posted
        }

    def _land_transfers(self) -> None:
        still = []
        # Carriers first: a parallel sample whose transfer ended waits for its prompt's.
        ordered = sorted(
            self.receiving, key=lambda t: t.group is not None and t.group.carrier is t, reverse=True
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
            self.transfer_totals.record(handle, *received_tokens(tracked.announce))
            error = None if tracked.aborted else landing_error(tracked, self.faults)
            if group is not None:
                error = group.landed(tracked, error)
            if tracked.aborted:
                self._forget(tracked)
            elif error is not None:
                self._fail(tracked, error, remove_from_receiving=False)
            else:
                self._join_running(tracked)
        self.receiving = still

    def _join_running(self, tracked: Tracked) -> None:
        req = tracked.req
        if req.trace is not None:
            landed = {
                "bytes": tracked.handle.nbytes,
                "wire_ms": tracked.wire_seconds() * 1e3,
                "reused_tokens": tracked.reused_tokens,
            }
            set_time(req, "transfer_end", landed)
        adopt_landed(tracked, self.metadata, self.speculator)
        req.finish_reason = self.engine.stop_checker.check(req)
        set_time_batch([req], "decode_admitted", "first_token")
        if req.finished:
            set_time(req, "finish")
            self._report(tracked)
            self._forget(tracked)
        else:
            self._report(tracked)
            self.engine.scheduler.add_running(req)

    def _step(self) -> None:
        """One engine step: a decode step of the running batch, or the re-prefill of retracted
        requests (the engine's policy: waiting prompts first)."""
        scheduler = self.engine.scheduler
        stepped = [*scheduler.running, *scheduler.waiting]
        finished = self.engine.step()
        set_time_batch(finished, "finish")
        done = {id(r) for r in finished}
        for req in stepped:
            tracked = self.rooms.get(int(req.request_id))
            # Nothing new for a request that was retracted, or waited, this step.
            if tracked is None or (
                len(req.output_token_ids) == tracked.stream.sent_tokens and not req.finished
            ):
                continue
            self._report(tracked)
            if id(req) in done:
                self._forget(tracked)

    def _report(self, tracked: Tracked) -> None:
        self.streams.report(
            tracked.stream,
            tracked.req,
            lambda: decode_final_stats(tracked, self.options.index, self.spec_totals),
        )

    def _abort(self, room: int) -> None:
        tracked = self.rooms.get(room)
        if tracked is None:
            return
        group = tracked.group
        if group is not None and not group.preallocated:
            group.leave_prealloc(tracked, self.prealloc)
            self._forget(tracked)
        elif tracked in self.prealloc:
            self.prealloc.remove(tracked)
            self._forget(tracked)
        elif tracked in self.receiving:
            # The KV may be on its way: keep the slots until the transfer ends, then free them.
            tracked.aborted = True
            self._abort_prefill(tracked)
        else:
            self.engine.abort(tracked.req.request_id)
            self._forget(tracked)

    def _abort_prefill(self, tracked: Tracked) -> None:
        """Tell the prefill node to drop an aborted request; a prompt's carrier only once no
        other sample waits for the prompt KV its transfer brings."""
        group = tracked.group
        rooms = [tracked.message.room] if group is None else group.prefill_aborts(tracked)
        for room in rooms:
            self.prefill_outboxes[tracked.message.prefill_node].send(AbortRequest(room))

    def _fail(self, tracked: Tracked, reason: str, remove_from_receiving: bool = True) -> None:
        if tracked.group is not None:
            tracked.group.failed(tracked, reason)
        if remove_from_receiving and tracked in self.receiving:
            if tracked.handle is not None and tracked.handle.state not in (
                TransferState.SUCCESS,
                TransferState.FAILED,
            ):
                # A receive is posted into these slots: free them when it ends.
                tracked.aborted = True
                self._send_error(tracked, reason)
                return
            self.receiving.remove(tracked)
        self._send_error(tracked, reason)
        self._forget(tracked)

    def _forget(self, tracked: Tracked) -> None:
        self.rooms.pop(tracked.message.room, None)
        self.streams.drop(tracked.stream)
        if tracked.handle is not None and tracked.handle.may_still_write:
            # Its receives stay posted (a timeout cannot cancel them) and land straight in the
            # slots: they must never hold another request's KV, so they are held until the
            # prefill node is replaced. The metadata row is safe to reuse: receives land it in
            # a staging tensor.
            self.quarantine.hold(
                tracked.req,
                tracked.message.room,
                tracked.handle.peer,
                f"a receive of its transfer is still posted: {tracked.handle.error}",
            )
        else:
            self._release(tracked.req)
        tracked.free_row(self.metadata)

    def _release(self, req) -> None:
        self.engine.kv_cache.release(req)
        if self.speculator is not None:
            self.speculator.release(req)

    def _drop_peer(self, index: int, rank: int, reason: str) -> None:
        """prefill-`index` died: end every request it was to prefill (the router has ended
        them already) and free their slots, receives still posted or not: nothing can come
        from a dead process. Then free what a stuck transfer from it held."""
        scheduler = self.engine.scheduler
        # Requests the engine holds (running, or retracted and waiting) need no prefill node.
        in_engine = {id(req) for req in [*scheduler.running, *scheduler.waiting]}
        for tracked in list(self.rooms.values()):
            if tracked.message.prefill_node != index or id(tracked.req) in in_engine:
                continue
            if tracked in self.prealloc:
                self.prealloc.remove(tracked)
            if tracked in self.receiving:
                self.receiving.remove(tracked)
            if not tracked.aborted:
                self._send_error(tracked, reason)
            self.streams.drop(tracked.stream)
            self.rooms.pop(tracked.message.room, None)
            self._release(tracked.req)
            tracked.free_row(self.metadata)
        for held in self.quarantine.release_peer(rank):
            self._release(held.req)
        log.warning("%s: requests and slots held for prefill-%d let go", reason, index)

    def _pool_counts(self) -> list[PoolCount]:
        requests = [t.req for t in self.rooms.values()]
        requests += [h.req for h in self.quarantine.requests()]
        rows_held = sum(1 for t in self.rooms.values() if t.meta_row is not None)
        rows_used = self.metadata.num_rows - self.metadata.num_free
        return request_pools(
            self.engine.runner.kv_pool.allocator.num_used,
            requests,
            self.speculator,
            (rows_used, rows_held),
            cached=self.kv_cache.cached_slots(),
        )

    def _send_error(self, tracked: Tracked, reason: str) -> None:
        self.streams.fail(tracked.stream.frontend, tracked.stream.room, reason)

    def _serving_error(self) -> str | None:
        return self.streams.error()

    def shutdown(self) -> None:
        super().shutdown()
        self.streams.shutdown()

    def _drop_frontend(self, frontend: int) -> None:
        self.frontends.forget(frontend)
        self.streams.forget(frontend)
        for tracked in list(self.rooms.values()):
            if tracked.stream.frontend == frontend:
                self._abort(tracked.message.room)
