"""The decode node: preallocates for each request, asks a prefill node to run it, receives the
prompt's KV and metadata row, then generates and streams tokens to the router.

Life of a request here: GenerateRequest -> prealloc queue (waits while KV or metadata rows are
short: backpressure) -> slots for the prompt and the first decode step taken (`first_step_slots`;
past the prefix its prefix cache holds, a conversation's earlier turns: decode_node.reuse) ->
PrefillRequest sent -> TransferAnnounce (sent when the prefill batch is admitted) -> receive posted
in announcement order, while the prefill runs -> PrefillResult (the first token's top logprobs and
the prefill timeline, or the prefill's error) -> landed (room tag checked) -> first token streamed,
request joins the running batch -> decode steps, its KV (the target's and each draft depth's)
growing step by step -> finished, slots freed (their KV kept in the cache until the pool needs
room). A transfer is settled once it ended and its PrefillResult came (both normally come together:
the result is sent before the KV); a result that reports an error fails the request at once, and its
slots are freed when the (void) transfer ends.

When the pool runs short mid-decode, the engine's scheduler retracts running requests (the rule is
engine.scheduling.scheduler.retraction_victim's): a retracted request waits in the engine's queue,
ahead of new preallocations, and runs again as a prefill of prompt + output so far (the node holds
the whole model), its draft state rebuilt by the draft extend for prefill, its output unchanged.

Parallel samples of one prompt (`GenerateRequest.samples`) share one prefill and one transfer of the
prompt's KV, in forked slots (decode_node.samples)."""

from __future__ import annotations

import logging
import time
from collections import deque

from decode_node.admission import accepted, prefill_request
from decode_node.incoming import IncomingTransfers
from decode_node.prealloc import preallocate_ready
from decode_node.prefill_peers import PrefillPeers
from decode_node.receives import adopt_landed
from decode_node.token_streams import TokenStreams, decode_final_stats, stream_sink
from decode_node.tracked import Tracked, held_pools
from engine.build import build_engine
from engine.loading.loader import EngineArgs
from engine.tracing import set_time, set_time_batch
from metadata.control import Inbox
from metadata.frontend_links import FrontendLinks, LoadReports
from metadata.kv_audit import PoolCount
from metadata.messages import (
    AbortRequest,
    FrontendHello,
    GenerateRequest,
    PrefillResult,
    TransferAbandoned,
    TransferAnnounce,
)
from metadata.node_common import NodeOptions, metadata_buffers, start_node_process, transfer_spec
from metadata.node_metrics import Activity, ActivityLog, SpeculationTotals
from metadata.pair_group import PairLink
from metadata.rank_kv import RankKV
from metadata.serving_node import ServingNode, poll_timeout_ms
from metadata.transfer import KVReceiver, TransferState
from spec.compose import speculation_of

log = logging.getLogger(__name__)


class DecodeNode(ServingNode):
    def __init__(self, args: EngineArgs, options: NodeOptions) -> None:
        super().__init__(options)
        start_node_process(args, options)
        built = build_engine(
            args,
            speculation_of(args),
            node_name=options.name,
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
        mine = transfer_spec(self.spec, self.num_draft_steps)
        self.prefill_peers = PrefillPeers(options.name, mine, options.control_key)
        self.frontends = FrontendLinks(options.control_key)
        self.streams = TokenStreams(
            stream_sink(self.spec, options, self.frontends), options.name, options.stream_interval
        )
        self.load_reports = LoadReports(self.frontends, "decode", options.index)
        self.rooms: dict[int, Tracked] = {}
        self.prealloc: deque[Tracked] = deque()
        self.rank_kv = RankKV.of(
            self.engine.runner, self.spec, False, options.transfer_timeout_s, options.name
        )
        self.incoming = IncomingTransfers(self.rank_kv, self.speculator, self.metadata, self.faults)
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
        self.prefill_peers.connect(prefill_endpoints, prefill_specs)
        self.incoming.prefill_ranks = dict(prefill_ranks)

    def peer_replaced(self, index: int, endpoint: str, spec: dict, link: PairLink) -> None:
        """(Ray call) prefill-`index` was replaced by a node at `endpoint`: check that it can
        pair, send its requests there, and open the new channel (and ranks' KV links)."""
        # Swapped here, before the router routes to the new node; the serving thread, which
        # owns the sockets, closes the old one.
        old = self.prefill_peers.replace(index, endpoint, spec)
        if old is not None:
            self._events.put(old.close)
        self.repair(link)

    def stats(self) -> dict:
        return {
            "node": self.options.name,
            "rank_kv": self.rank_kv.stats(),
            "running": len(self.engine.scheduler.running),
            "queued": self._num_waiting_for_kv(),
            "retractions": self.engine.scheduler.num_retractions,
            "receiving": len(self.incoming.requests),
            "kv_used": self.kv_cache.num_used_slots,
            "kv_capacity": self.kv_cache.capacity,
            "tokens_out": self.streams.tokens_out,
            "prefill_tokens": self.engine.prefill_tokens,
            **self.kv_cache.prefix_cache_stats(),
            **self.spec_totals.stats(),
            "spec_plans": self.engine.plan_counts(),
            "transfers_in_flight": self.incoming.in_flight(),
            "transfers": self.incoming.totals.as_dict(),
            "control_rejected": self.inbox.rejected,
            **self._health_stats(),
            **self._loop_stats(self.engine),
        }

    def _num_waiting_for_kv(self) -> int:
        """New requests waiting to preallocate, and retracted ones waiting to run again."""
        return len(self.prealloc) + len(self.engine.scheduler.waiting)

    def _open_channel(self) -> KVReceiver:
        return self.incoming.open_channel(self.spec.engine_config.device, self.options, self.rank)

    # --- the serving loop ---
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._housekeeping()
                for msg in self._receive(self._poll_timeout_ms()):
                    self._handle(msg)
                self._preallocate()
                self._land_transfers()
                self.loop_clock.lap("other")
                if self.engine.has_work():
                    self._step()
                self.loop_clock.lap("engine")
                self.streams.flush()
                self.loop_clock.lap("streams")
                kv_cache = self.kv_cache
                self.load_reports.tick(len(self.rooms), kv_cache.num_used_slots, kv_cache.capacity)
                self.activity_log.tick(self._activity)
        finally:
            self.frontends.close()

    def _activity(self) -> Activity:
        running = self.engine.scheduler.running
        return Activity(
            len(running),
            self._num_waiting_for_kv(),
            self.incoming.in_flight(),
            self.kv_cache.num_used_slots,
            self.kv_cache.capacity,
            self.streams.tokens_out,
            *self.spec_totals.with_running(running),
        )

    def _poll_timeout_ms(self) -> int:
        waiting = self.incoming.requests or self.prealloc or self.engine.scheduler.waiting
        return poll_timeout_ms(bool(self.engine.scheduler.running), bool(waiting))

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
        members = accepted(msg, self.engine, self.metadata, self.streams, self.options.name)
        for member in members:
            self.rooms[member.message.room] = member
        if members:
            self.prealloc.append(members[0])

    def _preallocate(self) -> None:
        for tracked, members in preallocate_ready(self.prealloc, self.engine, self.metadata):
            message = prefill_request(
                tracked.message, members[1:], self.options.index, self.rank, tracked.reused_tokens
            )
            self.prefill_peers.send(tracked.message.prefill_node, message)
            for member in members:
                set_time(member.req, "prefill_requested")  # the prefill node may run it
                self.incoming.requests.append(member)

    def _post_receive(self, announce: TransferAnnounce) -> None:
        tracked = self.rooms.get(announce.room)
        if tracked is not None and tracked.meta_row is None:
            tracked = None  # not asked of a prefill node yet, or already running
        failure = self.incoming.post(announce, tracked)
        if failure is not None and tracked is not None:
            self._fail(tracked, failure)

    def _take_result(self, result: PrefillResult) -> None:
        tracked = self.rooms.get(result.room)
        if tracked is None:
            return
        tracked.result, tracked.result_at = result, time.perf_counter()
        if result.error is not None:
            # The transfer still comes (void): its slots are freed when it ends.
            self._fail(tracked, result.error)

    def _unsettled_peers(self) -> set[int]:
        return self.incoming.unsettled_peers()

    def _land_transfers(self) -> None:
        self.incoming.land(self._landed)

    def _landed(self, tracked: Tracked, error: str | None) -> None:
        if tracked.aborted:
            self._forget(tracked)
        elif error is not None:
            self._fail(tracked, error, remove_from_receiving=False)
        else:
            self._join_running(tracked)

    def _join_running(self, tracked: Tracked) -> None:
        req = tracked.req
        adopt_landed(tracked, self.metadata, self.speculator)
        req.finish_reason = self.engine.stop_checker.check(req)
        set_time_batch([req], "decode_admitted", "first_token")
        if req.finished:
            set_time(req, "finish")
        self._report(tracked)
        if req.finished:
            self._forget(tracked)
        else:
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
        elif tracked in self.incoming.requests:
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
            self.prefill_peers.send(tracked.message.prefill_node, AbortRequest(room))

    def _fail(self, tracked: Tracked, reason: str, remove_from_receiving: bool = True) -> None:
        if tracked.group is not None:
            tracked.group.failed(tracked, reason)
        if remove_from_receiving and tracked in self.incoming.requests:
            if tracked.handle is not None and tracked.handle.state not in (
                TransferState.SUCCESS,
                TransferState.FAILED,
            ):
                # A receive is posted into these slots: free them when it ends.
                tracked.aborted = True
                self._send_error(tracked, reason)
                return
            self.incoming.remove(tracked)
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
            if tracked in self.incoming.requests:
                self.incoming.requests.remove(tracked)
            if not tracked.aborted:
                self._send_error(tracked, reason)
            # A receive still posted quarantines its slots for `rank`: let go just below.
            self._forget(tracked)
        for held in self.quarantine.release_peer(rank):
            self._release(held.req)
        log.warning("%s: requests and slots held for prefill-%d let go", reason, index)

    def _pool_counts(self) -> list[PoolCount]:
        quarantined = [held.req for held in self.quarantine.requests()]
        return held_pools(self.engine, self.speculator, self.metadata, self.rooms, quarantined)

    def _send_error(self, tracked: Tracked, reason: str) -> None:
        self.streams.fail(tracked.stream.frontend, tracked.stream.room, reason)

    def _serving_error(self) -> str | None:
        # A lost tensor parallel rank fails the whole node, which the supervisor replaces.
        return self.streams.error() or self.engine.runner.lost_rank()

    def shutdown(self) -> None:
        super().shutdown()
        self.streams.shutdown()

    def _drop_frontend(self, frontend: int) -> None:
        self.frontends.forget(frontend)
        self.streams.forget(frontend)
        for tracked in list(self.rooms.values()):
            if tracked.stream.frontend == frontend:
                self._abort(tracked.message.room)
