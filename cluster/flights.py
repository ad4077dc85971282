"""A request's flight through the router, from its routing to its end: the table of flights by
room that the decode nodes' token updates are delivered through, and the turning of a flight's
updates into detokenized deltas (with usage and trace at the end, an error when it failed)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cluster.backend import BackendError, TokenDelta, make_usage
from cluster.detokenizer import IncrementalDetokenizer
from cluster.metrics import failure_kind
from cluster.node_state import NodeState
from cluster.router_messages import speculation_usage, token_logprob
from cluster.tracing import NodeTimeline, RequestTimeline, TraceStore
from metadata.messages import TokenUpdate


@dataclass
class Flight:
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
    ended: bool = False  # let go of (`FlightTable.end`)


class NodeDied:
    """Queued to a flight in place of a token update when a node it needs died; `stage`: where
    the request was then."""

    def __init__(self, node: NodeState, stage: str) -> None:
        self.node, self.stage = node, stage


class FlightTable:
    """The router's flights by room, and the nodes' `in_flight` counts they hold: a flight
    counts on its decode node until it ends, and on its prefill node until its first token
    (`next_delta`) or its end."""

    def __init__(self) -> None:
        self._by_room: dict[int, Flight] = {}

    def add(self, flight: Flight) -> None:
        self._by_room[flight.room] = flight
        flight.decode.in_flight += 1
        if flight.prefill is not None:
            flight.prefill.in_flight += 1

    def deliver(self, update: TokenUpdate) -> None:
        """Queue a decode node's update to its flight; one no flight waits for is dropped."""
        flight = self._by_room.get(update.room)
        if flight is not None:
            flight.queue.put_nowait(update)

    def end(self, flight: Flight) -> bool:
        """Let go of `flight` and its nodes' counts; False when it was let go of before."""
        if flight.ended:
            return False
        flight.ended = True
        self._by_room.pop(flight.room, None)
        if not flight.got_first_token and flight.prefill is not None:
            flight.prefill.in_flight -= 1
        flight.decode.in_flight -= 1
        return True

    def fail_node(self, node: NodeState, aggregated: bool) -> None:
        """Fail the flights that need `node`, now dead: those it decodes, and those it prefills
        that have no token yet."""
        for flight in list(self._by_room.values()):
            if flight.decode is node:
                before_first = aggregated and not flight.got_first_token
                stage = "prefill" if before_first else "decode"
                flight.queue.put_nowait(NodeDied(node, stage))
            elif flight.prefill is node and not flight.got_first_token:
                flight.queue.put_nowait(NodeDied(node, "prefill"))


async def next_delta(flight: Flight, prefill_stage: str, traces: TraceStore | None) -> TokenDelta:
    """The flight's next delta (the last one with its finish reason and usage); raises
    BackendError when it failed. `prefill_stage`: the stage a failure before the first token
    names; `traces`: where a traced flight's trace is closed."""
    update = await flight.queue.get()
    prefill, decode_node, timer = flight.prefill, flight.decode, flight.timer
    if isinstance(update, NodeDied):
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
        stage = "decode" if flight.got_first_token else prefill_stage
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
    logprobs = [token_logprob(entry) for entry in update.logprobs]
    if update.finish_reason is None:
        return TokenDelta(list(update.token_ids), text, logprobs)
    flight.finished = True
    text += flight.detokenizer.finish()
    usage = make_usage(
        flight.prompt_tokens,
        flight.completion_tokens,
        prefill_node=(prefill or decode_node).name,
        decode_node=decode_node.name,
        **speculation_usage(update.stats),
    )
    timer.finished(update.finish_reason, usage)
    if flight.timeline is not None:
        usage["trace_summary"] = await close_trace(
            traces, flight.timeline, update, prefill, decode_node, usage
        )
    return TokenDelta(list(update.token_ids), text, logprobs, update.finish_reason, usage)


async def close_trace(
    traces: TraceStore,
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
    return await traces.finish(timeline, update.finish_reason, nodes, usage)
