"""The router: the cluster's GenerationBackend. It validates and tokenizes, mints a room per
request, picks a prefill and a decode node by policy, sends the request to the decode node (which
preallocates and drives the prefill node), and turns the decode node's token stream into
detokenized deltas. It watches node health, so a dead node ends its requests with an error.

Without prefill nodes the cluster is aggregated: each "decode" node is a replica that prefills
its own prompts (decode_node.AggregatedNode), picked by the decode policy, and stands for both
roles in usage, errors and traces.

`generate_samples` sends the parallel samples of one prompt as one request that shares its
prefill (decode_node.samples), each sample still a stream, an abort and a failure of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from cluster.backend import BackendError, TokenDelta, make_usage
from cluster.detokenizer import IncrementalDetokenizer
from cluster.metrics import ClusterMetrics, failure_kind
from cluster.node_state import NodeState
from cluster.policies import create_policy
from cluster.sample_streams import SharedPrefill
from cluster.tracing import NodeTimeline, RequestTimeline, TraceStore
from engine.errors import RequestRejectedError
from engine.loader import ModelSpec
from engine.prompt_embeds import PromptEmbeds
from engine.sampler import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.validation import chat_prompt_ids, validate_request
from metadata.control import Outbox
from metadata.control_auth import FrameVerifier
from metadata.messages import (
    AbortRequest,
    EmbeddingsSpec,
    GenerateRequest,
    MessageError,
    ParallelSample,
    SamplingSpec,
    TokenUpdate,
    decode,
)
from metadata.serving_node import NodeHealth

log = logging.getLogger(__name__)
HEALTH_INTERVAL_S = 1.0


@dataclass
class _Flight:
    """One request (one sample of a prompt) from its routing to its end."""

    prefill: NodeState | None  # None on an aggregated cluster
    decode: NodeState
    room: int
    prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    timer: Any
    timeline: RequestTimeline | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    got_first_token: bool = False
    completion_tokens: int = 0
    finished: bool = False  # its last delta or its error was taken
    ended: bool = False  # let go of (`Router._end_flight`)


class _NodeDied:
    def __init__(self, node: NodeState, stage: str) -> None:
        self.node, self.stage = node, stage


class Router:
    def __init__(
        self,
        spec: ModelSpec,
        prefill_nodes: list[NodeState],
        decode_nodes: list[NodeState],
        *,
        kv_cache_tokens: int,
        control_key: bytes,
        prefill_policy: str = "round_robin",
        decode_policy: str = "least_load",
        host: str = "127.0.0.1",
        model_name: str | None = None,
        tracing: bool = False,
        trace_dir: str | None = None,
    ) -> None:
        """`control_key`: the cluster's control-plane key (metadata.control_auth), which signs
        what the router sends and must sign what it receives. `tracing`: keep each request's
        trace (`traces`, GET /v1/traces/{id}) and its summary in `usage`, and write it to
        `trace_dir` if given; the nodes must trace too."""
        self.spec = spec
        self.tokenizer = spec.tokenizer
        self.model_name = model_name or spec.path.name
        self.max_model_len = spec.engine_config.max_model_len
        self.max_tokens_cap = spec.engine_config.max_tokens_cap
        self.kv_cache_tokens = kv_cache_tokens
        self.prefill_nodes = prefill_nodes
        self.decode_nodes = decode_nodes
        self.prefill_policy = create_policy(prefill_policy)
        self.decode_policy = create_policy(decode_policy)
        self.traces = TraceStore(trace_dir) if tracing else None
        self._control_key = control_key
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._verifier = FrameVerifier(control_key, self.endpoint)
        self.metrics = ClusterMetrics(
            prefill_nodes + decode_nodes, control_rejected=lambda: self._verifier.rejected
        )
        # Outboxes on a plain (blocking-API) context: a send only queues the message, so it
        # needs no await, and an abort sent from a cancelled generator's `finally` still goes
        # out.
        self._send_context = zmq.Context()
        self._outboxes: dict[int, Outbox] = {}
        self._flights: dict[int, _Flight] = {}
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # Told (on the event loop) when a node is found dead, or reports channels with peers
        # broken (the ranks): the cluster's supervisor replaces it.
        self.on_node_down: Callable[[NodeState], None] | None = None
        self.on_channels_broken: Callable[[NodeState, tuple[int, ...]], None] | None = None

    async def start(self) -> None:
        """Connect to the decode nodes and start listening; idempotent, and run on first use
        by whichever event loop serves the router."""
        if self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        for node in self.decode_nodes:
            self._outboxes[node.index] = Outbox(
                node.endpoint, self._control_key, self._send_context
            )
        self._tasks = [
            asyncio.create_task(self._receive_updates()),
            asyncio.create_task(self._watch_health()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.close_sockets()

    def close_sockets(self) -> None:
        """Close every socket and context now; idempotent, and safe once the serving event loop
        is gone. A context left to the garbage collector would block in term() on any socket
        still open, hanging whoever collects it."""
        if self._closed:
            return
        self._closed = True
        self._inbox.close(linger=0)
        for outbox in self._outboxes.values():
            outbox.close()
        self._context.term()
        self._send_context.term()

    @property
    def aggregated(self) -> bool:
        """Replicas that prefill their own prompts, no prefill nodes."""
        return not self.prefill_nodes

    @property
    def _decode_role(self) -> str:
        return "replica" if self.aggregated else "decode"

    @property
    def _prefill_stage(self) -> str:
        # Before the first token a disaggregated request may be anywhere between the prefill
        # node and the transfer's landing; an aggregated one is in its replica's prefill.
        return "prefill" if self.aggregated else "prefill/transfer"

    # --- GenerationBackend ---
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        try:
            validate_request(
                prompt_token_ids,
                params,
                vocab_size=self.spec.model_config.vocab_size,
                max_model_len=self.max_model_len,
                max_tokens_cap=self.max_tokens_cap,
                kv_cache_tokens=self.kv_cache_tokens,
                hidden_size=self.spec.model_config.hidden_size,
                prompt_embeds=prompt_embeds,
            )
        except RequestRejectedError:
            self.metrics.failure("rejected")
            raise

    async def health(self) -> dict[str, Any]:
        await self.start()
        nodes = []
        for n in self.prefill_nodes + self.decode_nodes:
            error = n.degraded if n.alive else n.error
            nodes.append(
                {
                    "name": n.name,
                    "status": n.status,
                    "in_flight": n.in_flight,
                    "restarts": n.restarts,
                    **({"error": error} if error else {}),
                }
            )
        alive_p = self.aggregated or any(n.alive for n in self.prefill_nodes)
        alive_d = any(n.alive for n in self.decode_nodes)
        all_alive = all(n["status"] == "ok" for n in nodes)
        status = "ok" if all_alive else ("degraded" if alive_p and alive_d else "down")
        return {"status": status, "nodes": nodes}

    async def metrics_text(self) -> bytes:
        """Prometheus exposition of the router's and every node's metrics."""
        await self.start()
        return await self.metrics.render()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
        trace_events: list[tuple[str, int]] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """`trace_events`: (name, time_ns) of what happened before (arrival, tokenized), from
        the HTTP layer when `traces` is set."""
        flight = None
        try:
            (flight,) = await self._open(
                [request_id], prompt_token_ids, [params], prompt_embeds, trace_events
            )
            while True:
                delta = await self._next_delta(flight)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if flight is not None:
                self._end_flight(flight)

    def generate_samples(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        prompt_embeds: PromptEmbeds | None = None,
        trace_events: list[tuple[str, int]] | None = None,
    ) -> list[AsyncIterator[TokenDelta]]:
        """Parallel samples of one prompt (`params[i]`: sample i's, differing by seed only),
        each a stream of its own, as `generate` gives, that shares one prefill of the prompt
        and one transfer of its KV with the others: they go to one decode node in one
        GenerateRequest. Closing a stream aborts that sample alone; close every stream. At
        most `max_num_seqs` samples share a prefill (a decode node holds no more at once)."""
        size = self.spec.engine_config.max_num_seqs
        streams: list[AsyncIterator[TokenDelta]] = []
        for start in range(0, len(request_ids), size):
            ids, group_params = request_ids[start : start + size], params[start : start + size]

            async def open_flights(wanted: list[int], ids=ids, group_params=group_params):
                return await self._open(
                    [ids[i] for i in wanted],
                    prompt_token_ids,
                    [group_params[i] for i in wanted],
                    prompt_embeds,
                    trace_events,
                )

            streams += SharedPrefill(
                len(ids), open_flights, self._next_delta, self._end_flight
            ).streams
        return streams

    async def _open(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        prompt_embeds: PromptEmbeds | None,
        trace_events: list[tuple[str, int]] | None,
    ) -> list[_Flight]:
        """Route a request (with the parallel samples of its prompt after it, which share its
        prefill) and send it to its decode node: a flight per sample."""
        traces = self.traces
        timelines = [
            traces.begin(request_id, trace_events) if traces is not None else None
            for request_id in request_ids
        ]
        await self.start()
        timers = [self.metrics.request() for _ in request_ids]
        decode_node = self._pick(self.decode_nodes, self.decode_policy, self._decode_role)
        prefill = None
        if not self.aggregated:
            prefill = self._pick(self.prefill_nodes, self.prefill_policy, "prefill")
        prefilled_by = prefill or decode_node
        flights = []
        for sample_params, timer, timeline in zip(params, timers, timelines):
            flight = _Flight(
                prefill,
                decode_node,
                secrets.randbits(63),
                len(prompt_token_ids),
                IncrementalDetokenizer(self.tokenizer, sample_params.stop_strings),
                timer,
                timeline,
            )
            self._flights[flight.room] = flight
            decode_node.in_flight += 1
            if prefill is not None:
                prefill.in_flight += 1
            if timeline is not None:
                timeline.room = flight.room
                timeline.mark("routed", {"prefill": prefilled_by.name, "decode": decode_node.name})
            flights.append(flight)
        first = flights[0]
        samples = [
            ParallelSample(flight.room, request_id, sample_params.seed)
            for flight, request_id, sample_params in zip(flights, request_ids, params)
        ]
        try:
            self._outboxes[decode_node.index].send(
                GenerateRequest(
                    first.room,
                    request_ids[0],
                    list(prompt_token_ids),
                    _sampling_spec(params[0]),
                    prefilled_by.index,
                    _embeddings_spec(prompt_embeds),
                    samples[1:],
                )
            )
        except BaseException:
            for flight in flights:
                self._end_flight(flight)
            raise
        return flights

    async def _next_delta(self, flight: _Flight) -> TokenDelta:
        """The flight's next delta (the last one with its finish reason and usage); raises
        BackendError when it failed."""
        update = await flight.queue.get()
        prefill, decode_node, timer = flight.prefill, flight.decode, flight.timer
        if isinstance(update, _NodeDied):
            flight.finished = True
            timer.failed("node_down")
            raise BackendError(
                f"{update.node.name} died: {update.node.error}",
                stage=update.stage,
                node=update.node.name,
                status=503,
            )
        if update.error is not None:
            flight.finished = True
            timer.failed(failure_kind(update.error))
            stage = "decode" if flight.got_first_token else self._prefill_stage
            raise BackendError(update.error, stage=stage, node=decode_node.name)
        if update.token_ids and not flight.got_first_token:
            flight.got_first_token = True
            if prefill is not None:
                prefill.in_flight -= 1
            if flight.timeline is not None:
                flight.timeline.mark("first_token")
        flight.completion_tokens += len(update.token_ids)
        timer.tokens(len(update.token_ids))
        text = flight.detokenizer.push(update.token_ids)
        logprobs = [_logprob(entry) for entry in update.logprobs]
        if update.finish_reason is None:
            return TokenDelta(list(update.token_ids), text, logprobs)
        flight.finished = True
        text += flight.detokenizer.finish()
        usage = make_usage(
            flight.prompt_tokens,
            flight.completion_tokens,
            prefill_node=(prefill or decode_node).name,
            decode_node=decode_node.name,
            **_speculation_usage(update.stats),
        )
        timer.finished(update.finish_reason, usage)
        if flight.timeline is not None:
            usage["trace_summary"] = await self._close_trace(
                flight.timeline, update, prefill, decode_node, usage
            )
        return TokenDelta(list(update.token_ids), text, logprobs, update.finish_reason, usage)

    def _end_flight(self, flight: _Flight) -> None:
        """Let go of a flight (once): an unfinished one is aborted on its decode node, which
        frees its KV there and on its prefill node."""
        if flight.ended:
            return
        flight.ended = True
        self._flights.pop(flight.room, None)
        if not flight.got_first_token and flight.prefill is not None:
            flight.prefill.in_flight -= 1
        flight.decode.in_flight -= 1
        if flight.finished:
            return
        flight.timer.failed("aborted")
        if flight.decode.alive and not self._closed:
            # The client went away (or the task was cancelled): free the request's KV.
            self._outboxes[flight.decode.index].send(AbortRequest(flight.room))

    # --- background tasks ---
    async def _receive_updates(self) -> None:
        while True:
            data = self._verifier.open(await self._inbox.recv())
            if data is None:
                continue
            try:
                update = decode(data)
            except MessageError as err:
                self._verifier.reject(f"malformed message: {err}")
                continue
            if not isinstance(update, TokenUpdate):
                continue
            flight = self._flights.get(update.room)
            if flight is not None:
                flight.queue.put_nowait(update)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            for node in self.prefill_nodes + self.decode_nodes:
                if node.alive:
                    await self._probe(node)

    async def _probe(self, node: NodeState) -> None:
        ping = node.ping
        try:
            health = await asyncio.wait_for(ping(), timeout=10 * HEALTH_INTERVAL_S)
        except Exception as err:  # noqa: BLE001 - any failed probe means the node is gone
            if node.ping is ping:  # not replaced meanwhile
                self.node_down(node, f"{type(err).__name__}: {err}")
            return
        if isinstance(health, NodeHealth) and node.ping is ping:
            node.degraded = health.degraded
            if health.broken_peers and self.on_channels_broken is not None:
                self.on_channels_broken(node, health.broken_peers)

    def node_down(self, node: NodeState, reason: str) -> None:
        """`node` is gone: its requests end with an error naming it, no new ones go there, and
        the supervisor (`on_node_down`) is told. Call on the event loop (`call_in_loop`)."""
        if not node.alive:
            return
        node.alive = False
        node.degraded = None
        node.error = reason.splitlines()[0][:300]
        log.error("%s is down: %s", node.name, node.error)
        self._fail_flights(node)
        if self.on_node_down is not None:
            self.on_node_down(node)

    def revive(
        self,
        node: NodeState,
        endpoint: str,
        ping: Callable[[], Awaitable[Any]],
        stats: Callable[[], Awaitable[dict]] | None,
    ) -> None:
        """A replacement of `node` serves at `endpoint`: route to it again. Call on the event
        loop (`call_in_loop`)."""
        node.ping, node.stats, node.endpoint = ping, stats, endpoint
        if any(n is node for n in self.decode_nodes) and self._tasks and not self._closed:
            old = self._outboxes.get(node.index)
            self._outboxes[node.index] = Outbox(endpoint, self._control_key, self._send_context)
            if old is not None:
                old.close()
        node.error = None
        node.degraded = None
        node.restarting = False
        node.alive = True
        log.info("%s is back (restart %d)", node.name, node.restarts)

    def call_in_loop(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0) -> Any:
        """Run `fn(*args)` on the router's event loop and return its result (from any thread;
        directly when no loop serves the router, or when called on it)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return fn(*args)
        try:
            if asyncio.get_running_loop() is loop:
                return fn(*args)
        except RuntimeError:
            pass  # no loop in this thread
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)

        loop.call_soon_threadsafe(run)
        return future.result(timeout_s)

    def _fail_flights(self, node: NodeState) -> None:
        for flight in list(self._flights.values()):
            if flight.decode is node:
                before_first = self.aggregated and not flight.got_first_token
                stage = "prefill" if before_first else "decode"
                flight.queue.put_nowait(_NodeDied(node, stage))
            elif flight.prefill is node and not flight.got_first_token:
                flight.queue.put_nowait(_NodeDied(node, "prefill"))

    def _pick(self, nodes: list[NodeState], policy, role: str) -> NodeState:
        alive = [n for n in nodes if n.alive]
        if not alive:
            self.metrics.failure("node_down")
            raise BackendError(f"no {role} node is alive", stage="routing", status=503)
        return policy.pick(alive)

    async def _close_trace(
        self,
        timeline: RequestTimeline,
        update: TokenUpdate,
        prefill: NodeState | None,
        decode: NodeState,
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        """Merge the nodes' timelines (in the finishing update's stats) into the request's
        trace; returns its summary."""
        reported = update.stats.get("trace") or {}
        nodes = [
            NodeTimeline(node.name, reported.get(node.role, []), node.clock_offset_ns)
            for node in (prefill, decode)
            if node is not None
        ]
        return await self.traces.finish(timeline, update.finish_reason, nodes, usage)


SPECULATION_USAGE_KEYS = ("completion_tokens_details", "spec_verify_steps", "spec_accept_length")


def _speculation_usage(stats: dict[str, Any]) -> dict[str, Any]:
    """The decode node's speculation figures, under the names `usage` carries them."""
    return {key: stats[key] for key in SPECULATION_USAGE_KEYS if key in stats}


def _embeddings_spec(prompt_embeds: PromptEmbeds | None) -> EmbeddingsSpec | None:
    if prompt_embeds is None:
        return None
    return EmbeddingsSpec(
        list(prompt_embeds.positions), prompt_embeds.width, prompt_embeds.to_bytes()
    )


def _sampling_spec(params: SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=float(params.temperature),
        top_k=params.top_k,
        top_p=float(params.top_p),
        seed=params.seed,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        logit_bias=[[token, bias] for token, bias in params.logit_bias_items],
        min_tokens=params.min_tokens,
        grammar=params.grammar,
    )


def _logprob(entry: list) -> TokenLogprob:
    token, logprob, top = entry
    return TokenLogprob(int(token), float(logprob), [(int(t), float(v)) for t, v in top])
