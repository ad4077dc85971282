"""Typed control-plane messages of the front ends' token streams and of the cluster's state:
front ends introduce themselves to the nodes (FrontendHello), a generating node hands its
stream worker each step's token ids (StreamStep) and each front end its requests' news
(TokenFrame, one a step), nodes report their load (NodeLoad), and the controller tells its API
processes the nodes' state (ClusterStatus)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from metadata.message_codec import MessageError, message


@message
class FrontendHello:
    """Front end -> node: send the token streams of this front end's requests (the requests
    whose GenerateRequest names `frontend`) to `endpoint`. Sent before a front end's first
    request to a node, and again to a node that replaced a dead one."""

    frontend: int
    endpoint: str


@message
class StreamLogprobs:
    """The log-probabilities of one entry's new tokens: [[token, logprob, [[id, lp], ...]]]."""

    entry: int
    logprobs: list[list[Any]]


@message
class StreamEnd:
    """How one entry's request ended: `finish_reason` and the node's statistics of it, or
    `error` (naming the node and what failed)."""

    entry: int
    finish_reason: str | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@message
class TokenFrame:
    """Node -> front end, at most one per node step: the news of every request of that front
    end that the step advanced or ended (its entries, in the order of `rooms`).

    Entry i is room `rooms[i]`: its `num_tokens[i]` new tokens (the next ones of the flat
    `token_ids`) and `texts[i]`, the text they complete (detokenized on the node, never a
    partial character nor a stop string). Rare facts are sparse: log-probabilities where asked,
    the end of a request (`ends`) where it ended."""

    rooms: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    texts: list[str]
    logprobs: list[StreamLogprobs] = field(default_factory=list)
    ends: list[StreamEnd] = field(default_factory=list)

    def check(self) -> None:
        """Raise MessageError unless the columns agree (decode calls it)."""
        n = len(self.rooms)
        if len(self.num_tokens) != n or len(self.texts) != n:
            raise MessageError("TokenFrame: rooms, num_tokens and texts differ in length")
        if any(count < 0 for count in self.num_tokens):
            raise MessageError("TokenFrame: a negative token count")
        if sum(self.num_tokens) != len(self.token_ids):
            raise MessageError("TokenFrame: num_tokens does not add up to token_ids")
        for extra in (*self.logprobs, *self.ends):
            if not 0 <= extra.entry < n:
                raise MessageError(f"TokenFrame: entry {extra.entry} out of range [0, {n})")


@message
class StreamOpen:
    """A request whose stream begins: its front end, and the stop strings its text is cut at."""

    room: int
    frontend: int
    stop: list[str] = field(default_factory=list)


@message
class StreamStep:
    """Node -> its stream worker (decode_node.stream_worker), at most once per step: the news
    of every request the step advanced or ended, as token ids, which the worker detokenizes and
    sends on to each request's front end as TokenFrames. Entry i is room `rooms[i]` with its
    `num_tokens[i]` next tokens of `token_ids`; `opened` introduces rooms before their first
    entry, `closed` lets go of rooms that ended without an entry (aborted)."""

    opened: list[StreamOpen]
    rooms: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    logprobs: list[StreamLogprobs] = field(default_factory=list)
    ends: list[StreamEnd] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    def check(self) -> None:
        """Raise MessageError unless the columns agree (decode calls it)."""
        n = len(self.rooms)
        if len(self.num_tokens) != n:
            raise MessageError("StreamStep: rooms and num_tokens differ in length")
        if any(count < 0 for count in self.num_tokens):
            raise MessageError("StreamStep: a negative token count")
        if sum(self.num_tokens) != len(self.token_ids):
            raise MessageError("StreamStep: num_tokens does not add up to token_ids")
        for extra in (*self.logprobs, *self.ends):
            if not 0 <= extra.entry < n:
                raise MessageError(f"StreamStep: entry {extra.entry} out of range [0, {n})")


@message
class ForgetFrontend:
    """Node -> its stream worker: a front end died; drop its socket and its requests' state."""

    frontend: int


@message
class NodeLoad:
    """Node -> every front end it serves, when its load changed (and at least every few
    seconds): what the routing policies weigh. `requests`: those it holds in any stage
    (queued, prefilling, receiving, running)."""

    role: str
    index: int
    requests: int
    kv_used: int
    kv_capacity: int


@message
class NodeStatus:
    """One node as the cluster's controller sees it (cluster.control.node_state.NodeState)."""

    role: str
    index: int
    endpoint: str
    alive: bool
    error: str | None = None
    degraded: str | None = None
    restarts: int = 0
    restarting: bool = False
    given_up: bool = False
    clock_offset_ns: int = 0
    stats: dict[str, Any] | None = None  # the node's latest stats(), for /metrics


@message
class ApiServerStatus:
    """One of several API processes as the controller sees it (cluster.frontend.api_servers)."""

    index: int
    pid: int  # 0 while it is being replaced
    up: bool
    restarts: int


@message
class ClusterStatus:
    """Controller -> every API process, whenever a node's state changes and every second: the
    nodes' health (a dead node fails the requests that need it; a replacement is introduced
    to, at its new endpoint), their latest stats, and the API processes' own state."""

    nodes: list[NodeStatus]
    api_servers: list[ApiServerStatus] = field(default_factory=list)
