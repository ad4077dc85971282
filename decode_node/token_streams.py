"""What a node that generates streams to the front ends: after each step, the news of every
request the step advanced or ended (its new tokens, their log-probabilities, and, once it
ended, why: an error naming the node, or the finish reason with the node's statistics; a
decode node's below), as one StreamStep of token ids.

The step goes to a sink: the node's stream worker process (decode_node.stream_worker), which
detokenizes it and sends each front end its TokenFrame, so that the thread that drives the
engine does no text work; or a FrameMaker in the node itself (decode_node.frames). With a
stream interval of N, a request's tokens go out once N of them are new (its first token, and
its last, at once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from decode_node.tracked import Tracked
from engine.request import Request
from metadata.messages import FrontendHello, StreamEnd, StreamLogprobs, StreamOpen, StreamStep
from metadata.node_metrics import SpeculationTotals


class StepSink(Protocol):
    """Where a node's StreamSteps go: a FrameMaker, or the stream worker's handle."""

    def apply(self, step: StreamStep) -> None: ...
    def hello(self, hello: FrontendHello) -> None: ...
    def forget(self, frontend: int) -> None: ...


@dataclass
class RequestStream:
    """One request's stream: its front end and room, and the output tokens sent so far."""

    frontend: int
    room: int
    sent_tokens: int = 0


@dataclass
class _Step:
    opened: list[StreamOpen] = field(default_factory=list)
    rooms: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[StreamLogprobs] = field(default_factory=list)
    ends: list[StreamEnd] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    def add(self, room: int, tokens: list[int]) -> int:
        entry = len(self.rooms)
        self.rooms.append(room)
        self.num_tokens.append(len(tokens))
        self.token_ids += tokens
        return entry

    def message(self) -> StreamStep:
        return StreamStep(
            self.opened,
            self.rooms,
            self.num_tokens,
            self.token_ids,
            self.logprobs,
            self.ends,
            self.closed,
        )


def stream_sink(spec: Any, options: Any, links: Any) -> StepSink:
    """A node's sink for its StreamSteps: its stream worker where `options.stream_worker`
    (a cluster's nodes), else a FrameMaker in the node itself over `links`."""
    from decode_node.frames import FrameMaker

    if not options.stream_worker:
        return FrameMaker(links, spec.tokenizer)
    from decode_node.stream_worker import StreamWorker, StreamWorkerConfig

    config = StreamWorkerConfig(
        options.name, str(spec.path), options.host, options.control_key.hex(), options.log_level
    )
    return StreamWorker(config)


class TokenStreams:
    """A node's streams of tokens to the front ends, handed to `sink` once per step (`flush`).
    Owned by the node's serving thread."""

    def __init__(self, sink: StepSink, node_name: str, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"the stream interval is at least 1 token, got {interval}")
        self.sink = sink
        self.node_name = node_name
        self.interval = interval
        self.tokens_out = 0
        self._step = _Step()
        self._open: set[int] = set()  # rooms the sink holds a stream of

    def open(self, frontend: int, room: int, stop_strings: tuple[str, ...] = ()) -> RequestStream:
        self._step.opened.append(StreamOpen(room, frontend, list(stop_strings)))
        self._open.add(room)
        return RequestStream(frontend, room)

    def report(
        self,
        stream: RequestStream,
        req: Request,
        final_stats: Callable[[], dict[str, Any]],
    ) -> None:
        """Queue `req`'s news past the tokens `stream` sent: its error, or its new tokens (held
        back below the interval unless they are its first or it finished) and, once it
        finished, its finish reason and `final_stats()`."""
        if req.error is not None:
            self.fail(stream.frontend, stream.room, f"{self.node_name}: {req.error}")
            return
        sent = stream.sent_tokens
        new = req.output_token_ids[sent:]
        finished = req.finished
        if not finished and (not new or (sent and len(new) < self.interval)):
            return
        step = self._step
        entry = step.add(stream.room, new)
        if req.logprobs and len(req.logprobs) > sent:
            entries = [
                [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top_logprobs]]
                for lp in req.logprobs[sent:]
            ]
            step.logprobs.append(StreamLogprobs(entry, entries))
        if finished:
            step.ends.append(StreamEnd(entry, req.finish_reason, stats=final_stats()))
            self._open.discard(stream.room)
        stream.sent_tokens = len(req.output_token_ids)
        self.tokens_out += len(new)

    def fail(self, frontend: int, room: int, error: str) -> None:
        """End `room`'s stream with `error` (which names where it failed)."""
        step = self._step
        if room not in self._open:
            step.opened.append(StreamOpen(room, frontend))
        self._open.discard(room)
        step.ends.append(StreamEnd(step.add(room, []), error=error))

    def drop(self, stream: RequestStream) -> None:
        """`stream`'s request was let go of without an end (aborted): its state goes."""
        if stream.room in self._open:
            self._open.discard(stream.room)
            self._step.closed.append(stream.room)

    def hello(self, hello: FrontendHello) -> None:
        self.sink.hello(hello)

    def forget(self, frontend: int) -> None:
        self.sink.forget(frontend)

    def flush(self) -> None:
        """Hand the sink this step's news, if any."""
        step = self._step
        if step.opened or step.rooms or step.closed:
            self._step = _Step()
            self.sink.apply(step.message())

    def error(self) -> str | None:
        """Why the sink can take no more (its worker is gone), if it cannot."""
        error = getattr(self.sink, "error", None)
        return error() if error is not None else None

    def shutdown(self) -> None:
        close = getattr(self.sink, "close", None)
        if close is not None:
            close()


def decode_final_stats(
    tracked: Tracked, decode_index: int, spec_totals: SpeculationTotals
) -> dict[str, Any]:
    """The statistics a decode node's last update of `tracked` carries: which nodes served it,
    its speculation figures, and both nodes' timelines when traced."""
    req = tracked.req
    stats = {
        "prefill_node": tracked.message.prefill_node,
        "decode_node": decode_index,
        "stop_string": req.stopped_by_string,
        **spec_totals.usage(req),
    }
    if tracked.result is not None and tracked.result.cached_tokens is not None:
        stats["cached_tokens"] = tracked.result.cached_tokens
    if req.trace is not None:
        prefill = tracked.result.trace if tracked.result is not None else []
        stats["trace"] = {"prefill": prefill, "decode": req.trace.events}
    return stats
