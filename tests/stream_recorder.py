"""A node's front end as a test sees it: the TokenFrames the node sends, read back as one update
per request entry (room, tokens, text, finish reason, error)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_node.frames import FrameMaker
from decode_node.token_streams import TokenStreams
from metadata.control_auth import new_control_key
from metadata.frontend_links import FrontendLinks
from metadata.messages import TokenFrame

FRONTEND = 7


@dataclass(frozen=True)
class Update:
    room: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None


class CharTokenizer:
    """Token i is chr(i): enough to detokenize made-up ids."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class StreamRecorder:
    """Stands for a front end's socket: `streams()` makes a node's TokenStreams that send here,
    and `updates` flushes them and reads every frame sent so far."""

    endpoint = "tcp://front-end.test:1"

    def __init__(self) -> None:
        self.frames: list[TokenFrame] = []
        self._streams: TokenStreams | None = None

    def send(self, msg: Any) -> None:
        if isinstance(msg, TokenFrame):
            self.frames.append(msg)

    def close(self) -> None:
        pass

    def streams(self, node_name: str, tokenizer: Any = None, interval: int = 1) -> TokenStreams:
        links = FrontendLinks(new_control_key(), make_outbox=lambda endpoint, key: self)
        links.open(FRONTEND, self.endpoint)
        maker = FrameMaker(links, tokenizer or CharTokenizer())
        self._streams = TokenStreams(maker, node_name, interval)
        return self._streams

    @property
    def updates(self) -> list[Update]:
        if self._streams is not None:
            self._streams.flush()
        return [update for frame in self.frames for update in frame_updates(frame)]


def frame_updates(frame: TokenFrame) -> list[Update]:
    ends = {end.entry: end for end in frame.ends}
    updates, offset = [], 0
    for entry, (room, count) in enumerate(zip(frame.rooms, frame.num_tokens)):
        end = ends.get(entry)
        updates.append(
            Update(
                room,
                frame.token_ids[offset : offset + count],
                frame.texts[entry],
                end.finish_reason if end else None,
                end.error if end else None,
            )
        )
        offset += count
    return updates
