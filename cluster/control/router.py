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
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from cluster.control.cache_aware import DEFAULT_LOAD_THRESHOLD
from cluster.control.health_watch import watch_health
from cluster.control.loop_calls import call_in_loop
from cluster.control.metrics import ClusterMetrics
from cluster.control.node_state import NodeState, health_report
from cluster.control.policies import Policy, PolicyOptions, create_policy
from cluster.control.router_messages import embeddings_spec, sampling_spec
from cluster.control.tracing import TraceStore
from cluster.frontend.backend import BackendError, TokenDelta
from cluster.frontend.cluster_status import follow_status
from cluster.frontend.flights import Flight, FlightTable, next_delta, take_tokens
from cluster.frontend.frontend_sockets import FrontEndSockets
from cluster.frontend.sample_streams import SharedPrefill
from engine.errors import RequestRejectedError
from engine.executor.prompt_embeds import PromptEmbeds
from engine.loading.loader import ModelSpec
from engine.sampling.sampling_params import SamplingParams
from engine.validation import chat_prompt_ids, validate_request
from metadata.messages import (
    AbortRequest,
    ClusterStatus,
    GenerateRequest,
    NodeLoad,
    ParallelSample,
    TokenFrame,
)

log = logging.getLogger(__name__)


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
        cache_aware_load_threshold: int = DEFAULT_LOAD_THRESHOLD,
        host: str = "127.0.0.1",
        model_name: str | None = None,
        tracing: bool = False,
        trace_dir: str | None = None,
        frontend_id: int | None = None,
        watch_health: bool = True,
        controller: str | None = None,
        multiprocess_dir: str | None = None,
        prune_trace_files: bool = False,
    ) -> None:
        """`control_key`: the cluster's control-plane key (metadata.control_auth), which signs what
        the router sends and must sign what it receives. `tracing`: keep each request's trace
        (`traces`, GET /v1/traces/{id}) and its summary in `usage`, and write it to `trace_dir` if
        given; the nodes must trace too. `cache_aware_load_threshold`: the cache_aware policy's
        (cluster.control.cache_aware), which takes `kv_cache_tokens` as a node's.

        One of several API processes (cluster.frontend.api_servers) does not probe the nodes itself
        (`watch_health=False`): it says hello to the cluster's `controller` (an endpoint) and
        follows the ClusterStatus it sends (cluster.frontend.cluster_status). `frontend_id`: who
        this front end is to the nodes (default: drawn at random); `multiprocess_dir`:
        ClusterMetrics'; `prune_trace_files`: TraceStore's."""
        self.spec = spec
        self.tokenizer = spec.tokenizer
        self.model_name = model_name or spec.path.name
        self.max_model_len = spec.engine_config.max_model_len
        self.max_tokens_cap = spec.engine_config.max_tokens_cap
        self.kv_cache_tokens = kv_cache_tokens
        self.prefill_nodes = prefill_nodes
        self.decode_nodes = decode_nodes
        options = PolicyOptions(kv_cache_tokens, cache_aware_load_threshold)
        self.prefill_policy = create_policy(prefill_policy, options)
        self.decode_policy = create_policy(decode_policy, options)
        self.traces = TraceStore(trace_dir, prune_files=prune_trace_files) if tracing else None
        # The API processes of the cluster, as the controller last told (several of them).
        self.api_servers: list[dict[str, Any]] | None = None
        self.metrics = ClusterMetrics(prefill_nodes + decode_nodes, multiprocess_dir)
        self.sockets = FrontEndSockets(
            control_key, host, frontend_id, on_reject=self.metrics.control_rejected.inc
        )
        self.endpoint = self.sockets.endpoint
        self._watch_health_enabled = watch_health
        self._controller = controller
        self._flights = FlightTable()
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Told (on the event loop) when a node is found dead, or reports channels with peers
        # broken (the ranks): the cluster's supervisor replaces it.
        self.on_node_down: Callable[[NodeState], None] | None = None
        self.on_channels_broken: Callable[[NodeState, tuple[int, ...]], None] | None = None
        # Told (on the event loop) when a node went down, came back or changed its health:
        # the API processes that follow this router hear it (cluster.frontend.api_servers).
        self.on_nodes_changed: Callable[[], None] | None = None

    async def start(self) -> None:
        """Connect to the decode nodes and start listening; idempotent, and run on first use
        by whichever event loop serves the router."""
        if self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        if self._controller is not None:
            self.sockets.connect_controller(self._controller)
        for node in self.decode_nodes + self.prefill_nodes:
            self.sockets.connect(node)
        self._tasks = [asyncio.create_task(self._receive_updates())]
        if self._watch_health_enabled:
            self._tasks.append(asyncio.create_task(watch_health(self)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.close_sockets()

    def close_sockets(self) -> None:
        """Close every socket now (FrontEndSockets.close); idempotent."""
        self.sockets.close()

    @property
    def frontend_id(self) -> int:
        """Who this front end is to the nodes: they stream its requests' tokens to its inbox."""
        return self.sockets.frontend_id

    @property
    def inbox_host(self) -> str:
        return self.sockets.host

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
        report = health_report(self.prefill_nodes, self.decode_nodes, self.aggregated)
        if self.api_servers is not None:
            report["api_servers"] = self.api_servers
        return report

    async def metrics_text(self) -> bytes:
        """Prometheus exposition of the router's and every node's metrics."""
        await self.start()
        return await self.metrics.render()

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
        trace_events: list[tuple[str, int]] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """`trace_events`: (name, time_ns) of what happened before (arrival, tokenized), from
        the HTTP layer when `traces` is set. The request is sent when the stream is first
        read."""
        return self.generate_samples(
            [request_id], prompt_token_ids, [params], prompt_embeds, trace_events
        )[0]

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
                len(ids), open_flights, self._next_delta, self._end_flight, take_tokens
            ).streams
        return streams

    async def _open(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        prompt_embeds: PromptEmbeds | None,
        trace_events: list[tuple[str, int]] | None,
    ) -> list[Flight]:
        """Route a request (with the parallel samples of its prompt after it, which share its
        prefill) and send it to its decode node: a flight per sample."""
        traces = self.traces
        timelines = [
            traces.begin(request_id, trace_events) if traces is not None else None
            for request_id in request_ids
        ]
        await self.start()
        timers = self.metrics.samples(len(request_ids))
        # A prompt given as vectors is not cached (engine.scheduling.kv_cache): route it by load
        # alone.
        routed_ids = prompt_token_ids if prompt_embeds is None else []
        decode_node = self._pick(self.decode_nodes, self._decode_role, routed_ids)
        prefill = None
        if not self.aggregated:
            prefill = self._pick(self.prefill_nodes, "prefill", routed_ids)
        prefilled_by = prefill or decode_node
        flights = []
        for timer, timeline in zip(timers, timelines):
            flight = Flight(
                prefill, decode_node, secrets.randbits(63), len(prompt_token_ids), timer, timeline
            )
            self._flights.add(flight)
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
            self.sockets.send_to_decode(
                decode_node.index,
                GenerateRequest(
                    first.room,
                    request_ids[0],
                    list(prompt_token_ids),
                    sampling_spec(params[0]),
                    prefilled_by.index,
                    self.frontend_id,
                    embeddings_spec(prompt_embeds),
                    samples[1:],
                )
            )
        except BaseException:
            for flight in flights:
                self._end_flight(flight)
            raise
        return flights

    def _next_delta(self, flight: Flight) -> Awaitable[TokenDelta]:
        return next_delta(flight, self._prefill_stage, self.traces)

    def _end_flight(self, flight: Flight) -> None:
        """Let go of a flight (once): an unfinished one is aborted on its decode node, which
        frees its KV there and on its prefill node."""
        if not self._flights.end(flight) or flight.finished:
            return
        flight.timer.failed("aborted")
        if flight.decode.alive and not self.sockets.closed:
            # The client went away (or the task was cancelled): free the request's KV.
            self.sockets.send_to_decode(flight.decode.index, AbortRequest(flight.room))

    # --- background tasks ---
    async def _receive_updates(self) -> None:
        receive, flights = self.sockets.receive, self._flights
        while True:
            msg = await receive()
            if isinstance(msg, TokenFrame):
                flights.deliver(msg)
            elif isinstance(msg, NodeLoad):
                self._node_load(msg)
            elif isinstance(msg, ClusterStatus) and not self._watch_health_enabled:
                follow_status(self, msg)

    def _node_load(self, load: NodeLoad) -> None:
        nodes = self.prefill_nodes if load.role == "prefill" else self.decode_nodes
        for node in nodes:
            if node.index == load.index:
                node.reported(load.requests)

    def node_down(self, node: NodeState, reason: str) -> None:
        """`node` is gone: its requests end with an error naming it, no new ones go there, and
        the supervisor (`on_node_down`) is told. Call on the event loop (`call_in_loop`)."""
        if not node.alive:
            return
        node.alive = False
        node.degraded = None
        node.error = reason.splitlines()[0][:300]
        log.error("%s is down: %s", node.name, node.error)
        self._flights.fail_node(node, self.aggregated)
        self._policy_for(node.role).forget(node.index)
        if self.on_node_down is not None:
            self.on_node_down(node)
        self.nodes_changed()

    def nodes_changed(self) -> None:
        if self.on_nodes_changed is not None:
            self.on_nodes_changed()

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
        node.forget_load()
        self._policy_for(node.role).forget(node.index)
        if self._tasks and not self.sockets.closed:
            self.sockets.connect(node)
        node.error = None
        node.degraded = None
        node.restarting = False
        node.alive = True
        log.info("%s is back (restart %d)", node.name, node.restarts)
        self.nodes_changed()

    def call_in_loop(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0) -> Any:
        """Run `fn(*args)` on the router's event loop and return its result (from any thread;
        directly when no loop serves the router, or when called on it)."""
        return call_in_loop(self._loop, fn, *args, timeout_s=timeout_s)

    def _policy_for(self, role: str) -> Policy:
        return self.prefill_policy if role == "prefill" else self.decode_policy

    def _pick(self, nodes: list[NodeState], role: str, prompt_token_ids: list[int]) -> NodeState:
        alive = [n for n in nodes if n.alive]
        if not alive:
            self.metrics.failure("node_down")
            raise BackendError(f"no {role} node is alive", stage="routing", status=503)
        node = self._policy_for(role).pick(alive, prompt_token_ids)
        node.routed_since_report += 1
        return node
