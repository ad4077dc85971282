"""The detokenizing side of a node's token streams: from each step's StreamStep (token ids), the
TokenFrames of the front ends (one per front end a step), with the text of every request's new
tokens, decoded incrementally (engine.detokenizer: never a partial character nor a stop string).

It runs in the node's stream worker process (decode_node.stream_worker), off the thread that
drives the node's engine; or in the node itself (`FrameMaker` as a TokenStreams sink), where
no worker runs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, TokenizerDecoding, tokenizer_decoding
from metadata.frontend_links import FrontendLinks
from metadata.messages import (
    FrontendHello,
    StreamEnd,
    StreamLogprobs,
    StreamStep,
    TokenFrame,
)

log = logging.getLogger(__name__)


@dataclass
class _Frame:
    rooms: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[StreamLogprobs] = field(default_factory=list)
    ends: list[StreamEnd] = field(default_factory=list)

    def message(self) -> TokenFrame:
        return TokenFrame(
            self.rooms, self.num_tokens, self.token_ids, self.texts, self.logprobs, self.ends
        )


@dataclass
class _Stream:
    frontend: int
    detokenizer: IncrementalDetokenizer


class FrameMaker:
    """Turns StreamSteps into the front ends' TokenFrames and sends them (`links`)."""

    def __init__(self, links: FrontendLinks, tokenizer: Any) -> None:
        self.links = links
        self._decoding: TokenizerDecoding = tokenizer_decoding(tokenizer)
        self._streams: dict[int, _Stream] = {}

    def __len__(self) -> int:
        """Requests whose stream is open."""
        return len(self._streams)

    def hello(self, hello: FrontendHello) -> None:
        self.links.open(hello.frontend, hello.endpoint)

    def forget(self, frontend: int) -> None:
        self.links.forget(frontend)
        for room in [r for r, s in self._streams.items() if s.frontend == frontend]:
            del self._streams[room]

    def apply(self, step: StreamStep) -> None:
        """Detokenize the step's news and send each front end its frame."""
        streams = self._streams
        for opened in step.opened:
            detokenizer = self._decoding.detokenizer(opened.stop)
            streams[opened.room] = _Stream(opened.frontend, detokenizer)
        logprobs = {extra.entry: extra.logprobs for extra in step.logprobs}
        ends = {end.entry: end for end in step.ends}
        frames: dict[int, _Frame] = {}
        token_ids, offset = step.token_ids, 0
        for entry, (room, count) in enumerate(zip(step.rooms, step.num_tokens)):
            tokens = token_ids[offset : offset + count]
            offset += count
            stream = streams.get(room)
            if stream is None:
                log.warning("news of room %s, which no stream holds: dropped", room)
                continue
            end = ends.get(entry) if ends else None
            text = stream.detokenizer.push(tokens) if tokens else ""
            if end is not None:
                if end.error is None:
                    text += stream.detokenizer.finish()
                del streams[room]
            frame = frames.get(stream.frontend)
            if frame is None:
                frame = frames[stream.frontend] = _Frame()
            index = len(frame.rooms)
            frame.rooms.append(room)
            frame.num_tokens.append(count)
            frame.token_ids += tokens
            frame.texts.append(text)
            if logprobs and entry in logprobs:
                frame.logprobs.append(StreamLogprobs(index, logprobs[entry]))
            if end is not None:
                frame.ends.append(StreamEnd(index, end.finish_reason, end.error, end.stats))
        for room in step.closed:
            streams.pop(room, None)
        for frontend, frame in frames.items():
            self.links.send(frontend, frame.message())
