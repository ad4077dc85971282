"""A request's flight through a front end, from its routing to its end: the table of flights by
room that the nodes' token frames are delivered through, and the turning of a flight's news into
deltas (with usage and trace at the end, an error when it failed).

A flight gathers its news as frames bring it (tokens, the text the node detokenized, their
log-probabilities, its end) and its stream takes everything gathered at once: a client that
reads slower than the node generates gets the tokens that waited for it as one delta.

A stream parked waiting for news may leave a `listener` on its flight, which the frame's
delivery calls instead of waking the stream: it takes plain tokens at once (`take_tokens`) and
writes them itself, so that a step costs no task wake-up per stream. An end, an error, and
any news the listener declines still wake the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.control.metrics import failure_kind
from cluster.control.node_state import NodeState
from cluster.control.router_messages import speculation_usage, token_logprob
from cluster.control.tracing import NodeTimeline, RequestTimeline, TraceStore
from cluster.frontend.backend import BackendError, TokenDelta, cached_prompt_usage, make_usage
from metadata.messages import StreamEnd, TokenFrame


class NodeDied:
    """A flight's end when a node it needs died; `stage`: where the request was then."""

    def __init__(self, node: NodeState, stage: str) -> None:
        self.node, self.stage = node, stage


@dataclass(eq=False)
class Flight:
    """One request (one sample of a prompt) from its routing to its end."""

    prefill: NodeState | None  # None on an aggregated cluster
    decode: NodeState
    room: int
    prompt_tokens: int
    timer: Any
    timeline: RequestTimeline | None
    # News not taken by the stream yet.
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[list[Any]] = field(default_factory=list)  # wire entries
    end: StreamEnd | NodeDied | None = None
    waiter: asyncio.Future | None = None
    # Called (while `waiter` waits) with news and no end: True when it took the news itself.
    listener: Callable[[], bool] | None = None
    got_first_token: bool = False
    completion_tokens: int = 0
    finished: bool = False  # its last delta or its error was taken
    ended: bool = False  # let go of (`FlightTable.end`)

    def news(
        self, tokens: list[int], text: str, logprobs: list | None, end: StreamEnd | None
    ) -> None:
        if self.end is not None:
            return  # nothing comes after an end
        self.token_ids += tokens
        if text:
            self.texts.append(text)
        if logprobs:
            self.logprobs += logprobs
        if end is not None:
            self.end = end
        self._wake()

    def fail(self, died: NodeDied) -> None:
        if self.end is None:
            self.end = died
            self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        listener = self.listener
        if listener is not None and self.end is None:
            try:
                if listener():
                    return
            except Exception as err:  # noqa: BLE001 - the stream raises it where it waits
                waiter.set_exception(err)
                return
        waiter.set_result(None)

    @property
    def has_news(self) -> bool:
        return bool(self.token_ids or self.texts or self.end is not None)


class FlightTable:
    """The front end's flights by room, and the nodes' `in_flight` counts they hold: a flight
    counts on its decode node until it ends, and on its prefill node until its first token
    (`next_delta`) or its end."""

    def __init__(self) -> None:
        self._by_room: dict[int, Flight] = {}

    def __len__(self) -> int:
        return len(self._by_room)

    def add(self, flight: Flight) -> None:
        self._by_room[flight.room] = flight
        flight.decode.in_flight += 1
        if flight.prefill is not None:
            flight.prefill.in_flight += 1

    def deliver(self, frame: TokenFrame) -> None:
        """Hand each entry of a node's frame to its flight; an entry no flight waits for is
        dropped (its request was let go of)."""
        by_room = self._by_room
        logprobs = {extra.entry: extra.logprobs for extra in frame.logprobs}
        ends = {extra.entry: extra for extra in frame.ends}
        token_ids, texts, offset = frame.token_ids, frame.texts, 0
        for entry, (room, count) in enumerate(zip(frame.rooms, frame.num_tokens)):
            flight = by_room.get(room)
            if flight is not None:
                flight.news(
                    token_ids[offset : offset + count],
                    texts[entry],
                    logprobs.get(entry) if logprobs else None,
                    ends.get(entry) if ends else None,
                )
            offset += count

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
                flight.fail(NodeDied(node, "prefill" if before_first else "decode"))
            elif flight.prefill is node and not flight.got_first_token:
                flight.fail(NodeDied(node, "prefill"))


async def next_delta(flight: Flight, prefill_stage: str, traces: TraceStore | None) -> TokenDelta:
    """Everything the flight gathered since the last call, as one delta (the last one with its
    finish reason and usage); raises BackendError when it failed, after the tokens that came
    before the failure. `prefill_stage`: the stage a failure before the first token names;
    `traces`: where a traced flight's trace is closed."""
    while not flight.has_news:
        flight.waiter = asyncio.get_running_loop().create_future()
        try:
            await flight.waiter
        finally:
            flight.waiter = None
    end = flight.end
    failed = isinstance(end, NodeDied) or (end is not None and end.error is not None)
    if flight.token_ids or flight.texts:
        delta = _take(flight)
        if end is None or failed:
            # A failure is raised at the next call, after the tokens that came before it.
            return delta
        tokens, text, logprobs = delta.token_ids, delta.text, delta.logprobs
    else:
        tokens, text, logprobs = [], "", []
    flight.finished = True
    if isinstance(end, NodeDied):
        flight.timer.failed("node_down")
        raise BackendError(
            f"{end.node.name} died: {end.node.error}",
            stage=end.stage,
            node=end.node.name,
            status=503,
        )
    if end.error is not None:
        flight.timer.failed(failure_kind(end.error))
        stage = "decode" if flight.got_first_token else prefill_stage
        raise BackendError(end.error, stage=stage, node=flight.decode.name)
    return await _last_delta(flight, end, tokens, text, logprobs, traces)


def take_tokens(flight: Flight) -> TokenDelta | None:
    """What `next_delta` would return at once when the flight has tokens and no end yet (None
    otherwise: nothing new, or its end, which only `next_delta` takes)."""
    if flight.end is not None or not (flight.token_ids or flight.texts):
        return None
    return _take(flight)


def _take(flight: Flight) -> TokenDelta:
    """The tokens, text and log-probabilities gathered since the last take, as one delta."""
    tokens, texts, wire_logprobs = flight.token_ids, flight.texts, flight.logprobs
    flight.token_ids, flight.texts, flight.logprobs = [], [], []
    _count_tokens(flight, len(tokens))
    logprobs = [token_logprob(entry) for entry in wire_logprobs] if wire_logprobs else []
    return TokenDelta(tokens, "".join(texts) if len(texts) != 1 else texts[0], logprobs)


def _count_tokens(flight: Flight, count: int) -> None:
    if count and not flight.got_first_token:
        flight.got_first_token = True
        if flight.prefill is not None:
            flight.prefill.in_flight -= 1
        if flight.timeline is not None:
            flight.timeline.mark("first_token")
    flight.completion_tokens += count
    flight.timer.tokens(count)


async def _last_delta(
    flight: Flight,
    end: StreamEnd,
    tokens: list[int],
    text: str,
    logprobs: list,
    traces: TraceStore | None,
) -> TokenDelta:
    prefill, decode_node = flight.prefill, flight.decode
    usage = make_usage(
        flight.prompt_tokens,
        flight.completion_tokens,
        prefill_node=(prefill or decode_node).name,
        decode_node=decode_node.name,
        **cached_prompt_usage(end.stats.get("cached_tokens")),
        **speculation_usage(end.stats),
    )
    flight.timer.finished(end.finish_reason, usage)
    if flight.timeline is not None:
        usage["trace_summary"] = await close_trace(
            traces, flight.timeline, end, prefill, decode_node, usage
        )
    return TokenDelta(tokens, text, logprobs, end.finish_reason, usage)


async def close_trace(
    traces: TraceStore,
    timeline: RequestTimeline,
    end: StreamEnd,
    prefill: NodeState | None,
    decode: NodeState,
    usage: dict[str, Any],
) -> dict[str, Any]:
    """Merge the nodes' timelines (in the finishing entry's stats) into the request's trace;
    returns its summary."""
    reported = end.stats.get("trace") or {}
    nodes = [
        NodeTimeline(node.name, reported.get(node.role, []), node.clock_offset_ns)
        for node in (prefill, decode)
        if node is not None
    ]
    return await traces.finish(timeline, end.finish_reason, nodes, usage)
