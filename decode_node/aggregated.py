"""The aggregated node: one engine that prefills and decodes its own requests, behind the same
router, protocol, metrics and tracing as a disaggregated pair. It is the baseline that
disaggregation has to beat, and what to run where disaggregation does not pay.

It speaks the decode node's side of the protocol (GenerateRequest and AbortRequest in,
TokenFrame out) and ignores the prefill node a request names: no KV crosses, so it joins no
process group and holds no metadata rows. Its requests wait in the engine's own queue, which
admits them as KV frees up, and prefill and decode share its steps (EngineCore's policy:
waiting prompts first). Parallel samples of one prompt (`GenerateRequest.samples`) share its
prefill and KV (`EngineCore.add_samples`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

from decode_node.samples import sample_messages
from decode_node.token_streams import RequestStream, TokenStreams, stream_sink
from engine.build import build_engine
from engine.errors import RequestRejectedError
from engine.executor.prompt_embeds import PromptEmbeds
from engine.loading.loader import EngineArgs
from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from engine.tracing import set_time
from metadata.control import Inbox
from metadata.frontend_links import FrontendLinks, LoadReports
from metadata.kv_audit import PoolCount, request_pools
from metadata.messages import AbortRequest, FrontendHello, GenerateRequest
from metadata.node_common import NodeOptions, start_node_process
from metadata.node_metrics import Activity, ActivityLog, SpeculationTotals
from metadata.serving_node import ServingNode
from spec.compose import speculation_of

log = logging.getLogger(__name__)
IDLE_POLL_MS = 5


@dataclass
class _Served:
    req: Request
    stream: RequestStream


class AggregatedNode(ServingNode):
    def __init__(self, args: EngineArgs, options: NodeOptions) -> None:
        super().__init__(options)
        start_node_process(args, options)
        built = build_engine(
            args, speculation_of(args), node_name=options.name, tracing=options.enable_tracing
        )
        self.spec, self.engine = built.spec, built.core
        self.speculator, self.num_draft_steps = built.speculator, built.num_draft_steps
        self.kv_cache = self.engine.kv_cache
        self.inbox = Inbox(options.host, options.control_key)
        self.frontends = FrontendLinks(options.control_key)
        self.streams = TokenStreams(
            stream_sink(self.spec, options, self.frontends), options.name, options.stream_interval
        )
        self.load_reports = LoadReports(self.frontends, "replica", options.index)
        self.rooms: dict[int, _Served] = {}
        self.prompt_tokens = 0
        self.spec_totals = SpeculationTotals()
        self.activity_log = ActivityLog(options.stats_log_interval_s, log)

    # --- setup and health (Ray calls) ---
    def stats(self) -> dict:
        allocator = self.engine.runner.kv_pool.allocator
        return {
            "node": self.options.name,
            "running": len(self.engine.scheduler.running),
            "queued": len(self.engine.scheduler.waiting),
            "retractions": self.engine.scheduler.num_retractions,
            "kv_used": self.kv_cache.num_used_slots,
            "kv_capacity": allocator.capacity,
            "tokens_out": self.streams.tokens_out,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.engine.prefill_tokens,
            **self.spec_totals.stats(),
            "spec_plans": self.engine.plan_counts(),
            "control_rejected": self.inbox.rejected,
            **self._health_stats(),
            **self._loop_stats(self.engine),
        }

    def kv_is_empty(self) -> bool:
        drafts_empty = self.speculator is None or self.speculator.is_empty()
        return self.kv_cache.is_empty() and drafts_empty

    # --- the serving loop ---
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._housekeeping()
                busy = self.engine.has_work()
                for msg in self._receive(0 if busy else IDLE_POLL_MS):
                    self._handle(msg)
                self.loop_clock.lap("other")
                if self.engine.has_work():
                    self._step()
                self.loop_clock.lap("engine")
                self.streams.flush()
                self.loop_clock.lap("streams")
                allocator = self.engine.runner.kv_pool.allocator
                self.load_reports.tick(
                    len(self.rooms), self.kv_cache.num_used_slots, allocator.capacity
                )
                self.activity_log.tick(self._activity)
        finally:
            self.frontends.close()

    def _activity(self) -> Activity:
        allocator = self.engine.runner.kv_pool.allocator
        running = self.engine.scheduler.running
        return Activity(
            len(running),
            len(self.engine.scheduler.waiting),
            0,
            self.kv_cache.num_used_slots,
            allocator.capacity,
            self.streams.tokens_out,
            *self.spec_totals.with_running(running),
        )

    def _handle(self, msg: object) -> None:
        if isinstance(msg, FrontendHello):
            self.frontends.open(msg.frontend, msg.endpoint)
            self.streams.hello(msg)
        elif isinstance(msg, GenerateRequest):
            self.faults.request_arrived()
            self._accept(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.room)
        else:
            log.warning("unexpected message %s", type(msg).__name__)

    def _accept(self, msg: GenerateRequest) -> None:
        messages = sample_messages(msg) if msg.samples else [msg]
        try:
            embeds = None
            if msg.prompt_embeds is not None:
                given = msg.prompt_embeds
                embeds = PromptEmbeds.from_bytes(given.positions, given.width, given.data)
            # One list of prompt tokens and one of vectors: the samples' prompt is one.
            prompt = list(msg.prompt_token_ids)
            requests = [
                self.engine.make_request(
                    str(m.room), prompt, SamplingParams(**m.sampling.__dict__), prompt_embeds=embeds
                )
                for m in messages
            ]
            taken = [m.room for m in messages if m.room in self.rooms]
            if taken:
                raise ValueError(f"room {taken[0]} is taken")
        except (RequestRejectedError, ValueError) as err:
            for m in messages:
                self.streams.fail(msg.frontend, m.room, f"{self.options.name}: {err}")
            return
        for req, m in zip(requests, messages):
            set_time(req, "decode_received")
            stream = self.streams.open(msg.frontend, m.room, req.params.stop_strings)
            self.rooms[m.room] = _Served(req, stream)
        self.prompt_tokens += len(prompt)
        if len(requests) == 1:
            self.engine.add_request(requests[0])
        else:
            self.engine.add_samples(requests)

    def _step(self) -> None:
        finished = self.engine.step()
        # Only the requests this step ran can have news: the running ones, and those it ended.
        for req in [*self.engine.scheduler.running, *finished]:
            served = self.rooms.get(int(req.request_id))
            stream = served.stream if served is not None else None
            if stream is None or (
                len(req.output_token_ids) == stream.sent_tokens and not req.finished
            ):
                continue
            if stream.sent_tokens == 0 and req.output_token_ids:
                set_time(req, "first_token")
            if req.finished:
                set_time(req, "finish")
                del self.rooms[stream.room]
            self.streams.report(stream, req, partial(self._final_stats, req))

    def _final_stats(self, req: Request) -> dict:
        stats = {"stop_string": req.stopped_by_string, **self.spec_totals.usage(req)}
        if self.kv_cache.prefix_cache is not None:
            stats["cached_tokens"] = req.cached_tokens
        if req.trace is not None:
            stats["trace"] = {"replica": req.trace.events}
        return stats

    def _abort(self, room: int) -> None:
        served = self.rooms.pop(room, None)
        if served is not None:
            self.engine.abort(served.req.request_id)
            self.streams.drop(served.stream)

    def _drop_peer(self, index: int, rank: int, reason: str) -> None:
        """A replica has no peers: nothing is held for another node."""

    def _serving_error(self) -> str | None:
        # A lost tensor parallel rank fails the whole node, which the supervisor replaces.
        return self.streams.error() or self.engine.runner.lost_rank()

    def shutdown(self) -> None:
        super().shutdown()
        self.streams.shutdown()

    def _drop_frontend(self, frontend: int) -> None:
        self.frontends.forget(frontend)
        self.streams.forget(frontend)
        for room, served in list(self.rooms.items()):
            if served.stream.frontend == frontend:
                self._abort(room)

    def _pool_counts(self) -> list[PoolCount]:
        requests = [served.req for served in self.rooms.values()]
        return request_pools(
            self.engine.runner.kv_pool.allocator.num_used,
            requests,
            self.speculator,
            cached=self.kv_cache.cached_slots(),
        )
