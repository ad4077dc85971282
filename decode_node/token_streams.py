"""What a node that generates streams to the front ends: after each step, one TokenFrame per
front end with the news of every request of that front end the step advanced or ended (its new
tokens, the text they complete, their log-probabilities, and, once it ended, why: an error
naming the node, or the finish reason with the node's statistics; a decode node's below).

Text is detokenized here, per request, as the tokens are made (engine.detokenizer): a front end
only joins the pieces. With a stream interval of N, a request's tokens go out once N of them
are new (its first token, and its last, at once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decode_node.tracked import Tracked
from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request
from metadata.frontend_links import FrontendLinks
from metadata.messages import StreamEnd, StreamLogprobs, TokenFrame
from metadata.node_metrics import SpeculationTotals


@dataclass
class RequestStream:
    """One request's stream: its front end and room, the output tokens sent so far, and the
    detokenizer that turns them into text."""

    frontend: int
    room: int
    detokenizer: IncrementalDetokenizer
    sent_tokens: int = 0


@dataclass
class _FrameBuilder:
    rooms: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[StreamLogprobs] = field(default_factory=list)
    ends: list[StreamEnd] = field(default_factory=list)

    def add(self, room: int, tokens: list[int], text: str) -> int:
        entry = len(self.rooms)
        self.rooms.append(room)
        self.num_tokens.append(len(tokens))
        self.token_ids += tokens
        self.texts.append(text)
        return entry

    def frame(self) -> TokenFrame:
        return TokenFrame(
            self.rooms, self.num_tokens, self.token_ids, self.texts, self.logprobs, self.ends
        )


class TokenStreams:
    """A node's streams of tokens to the front ends, sent once per step (`flush`). Owned by the
    node's serving thread."""

    def __init__(self, links: FrontendLinks, tokenizer: Any, node_name: str, interval: int = 1):
        if interval < 1:
            raise ValueError(f"the stream interval is at least 1 token, got {interval}")
        self.links = links
        self.tokenizer = tokenizer
        self.node_name = node_name
        self.interval = interval
        self.tokens_out = 0
        self._frames: dict[int, _FrameBuilder] = {}

    def open(self, frontend: int, room: int, stop_strings: tuple[str, ...] = ()) -> RequestStream:
        return RequestStream(frontend, room, IncrementalDetokenizer(self.tokenizer, stop_strings))

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
        text = stream.detokenizer.push(new)
        if finished:
            text += stream.detokenizer.finish()
        frame = self._frame(stream.frontend)
        entry = frame.add(stream.room, new, text)
        if req.logprobs and len(req.logprobs) > sent:
            entries = [
                [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top_logprobs]]
                for lp in req.logprobs[sent:]
            ]
            frame.logprobs.append(StreamLogprobs(entry, entries))
        if finished:
            frame.ends.append(StreamEnd(entry, req.finish_reason, stats=final_stats()))
        stream.sent_tokens = len(req.output_token_ids)
        self.tokens_out += len(new)

    def fail(self, frontend: int, room: int, error: str) -> None:
        """End `room`'s stream with `error` (which names where it failed)."""
        frame = self._frame(frontend)
        entry = frame.add(room, [], "")
        frame.ends.append(StreamEnd(entry, error=error))

    def flush(self) -> None:
        """Send each front end its frame of this step, if it has news."""
        frames, self._frames = self._frames, {}
        for frontend, frame in frames.items():
            self.links.send(frontend, frame.frame())

    def _frame(self, frontend: int) -> _FrameBuilder:
        frame = self._frames.get(frontend)
        if frame is None:
            frame = self._frames[frontend] = _FrameBuilder()
        return frame


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
    if req.trace is not None:
        prefill = tracked.result.trace if tracked.result is not None else []
        stats["trace"] = {"prefill": prefill, "decode": req.trace.events}
    return stats
