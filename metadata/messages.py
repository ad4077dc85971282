"""Typed control-plane messages, encoded with msgpack (never pickle).

Every message is a frozen dataclass with a registered type name. On the wire it is a msgpack map
{"type": name, "version": PROTOCOL_VERSION, "body": {field: value}}; `decode` checks the type, the
version and every field's type, and raises MessageError on anything else. Each class's decoder
and encoder are built once, on its first use, from its type hints: a message on the hot path (a
node's TokenFrame, every step) costs a pass over its fields, never a reflection."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 4


class MessageError(ValueError):
    """A control-plane message could not be decoded or failed validation."""


_REGISTRY: dict[str, type] = {}


def message(cls: type) -> type:
    cls = dataclass(frozen=True)(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


@message
class SamplingSpec:
    """The sampling settings that cross the wire (engine.SamplingParams' fields)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    # Logits processors (engine.logits_processors); the defaults ask for none, so a sender
    # that predates them still decodes.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[list[Any]] = field(default_factory=list)  # [[token id, bias], ...]
    min_tokens: int = 0
    # Structured output: llguidance grammar text (engine.grammar), compiled by each node.
    grammar: str | None = None


@message
class EmbeddingsSpec:
    """Vectors given for some prompt positions (engine.prompt_embeds.PromptEmbeds): `data` is
    len(positions) x width float32 values, little-endian, row after row."""

    positions: list[int]
    width: int
    data: bytes


@message
class ParallelSample:
    """Another sample of a request's prompt (`n` > 1): a request of its own (room, id, abort,
    token stream) that shares the prompt's prefill and KV. Samples of one prompt differ by
    their seed stream only (engine.SamplingParams.for_sample)."""

    room: int
    request_id: str
    seed: int | None


@message
class GenerateRequest:
    """Front end -> decode node: preallocate for this request, then ask `prefill_node` to run it.
    `samples`: the prompt's other samples, which share its prefill (one prefill, one transfer
    of the prompt's target KV, forked slots on the decode node)."""

    room: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_node: int
    # The front end (API process) that streams it: its tokens go there (FrontendHello).
    frontend: int
    prompt_embeds: EmbeddingsSpec | None = None
    samples: list[ParallelSample] = field(default_factory=list)


@message
class PrefillRequest:
    """Decode node -> prefill node: slots are reserved; compute and send to `decode_rank`."""

    room: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    decode_node: int
    decode_rank: int
    prompt_embeds: EmbeddingsSpec | None = None
    # The prompt's other samples: one prefill for all; this room's transfer carries the
    # prompt's target KV, each sample's its own first token, chain and draft KV.
    samples: list[ParallelSample] = field(default_factory=list)


@message
class TransferAnnounce:
    """Prefill node -> decode node, when the request's prefill batch is admitted (before its
    forward): receive `num_tokens` of KV next. Every announced transfer is sent, whatever
    happens to the prefill; its PrefillResult says whether what lands is the request's KV."""

    room: int
    prefill_rank: int
    num_tokens: int
    # Draft depths whose KV and chain follow the target's KV (0: this request does not draft).
    num_draft_tokens: int = 0
    # A parallel sample that shares its prompt's KV: the room whose transfer carries the
    # prompt's target KV and each draft depth's (this one then carries no target KV, only each
    # depth's positions from spec.sample_extend.shared_prompt_len on, and its row). 0: this
    # transfer carries its own prompt's.
    prompt_room: int = 0


@message
class PrefillResult:
    """Prefill node -> decode node, after the forward and before the announced transfer is
    sent: what the metadata row does not carry, or why the prefill failed (`error`, naming
    the prefill node). A failed prefill still sends its announced transfer, under a row whose
    room tag never matches, because the decode node's receives are posted and cannot be
    cancelled."""

    room: int
    # Top log-probabilities of the first token, when the request asked for them: [[id, lp], ...]
    first_token_top_logprobs: list[list[Any]] = field(default_factory=list)
    # The request's timeline on the prefill node when it traces: [[name, time_ns(, args)], ...]
    trace: list[list[Any]] = field(default_factory=list)
    error: str | None = None


@message
class TransferAbandoned:
    """Prefill node -> decode node: this room will not be sent nor announced (refused, or
    aborted or failed before the step that completes its prompt)."""

    room: int
    reason: str


@message
class AbortRequest:
    """Front end -> decode node, decode node -> prefill node: stop the request, free its
    slots."""

    room: int


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
    """One node as the cluster's controller sees it (cluster.node_state.NodeState)."""

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
    """One of several API processes as the controller sees it (cluster.api_servers)."""

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


def encode(msg: Any) -> bytes:
    cls = type(msg)
    if _REGISTRY.get(cls.__name__) is not cls:
        raise MessageError(f"{cls.__name__} is not a registered message type")
    body = _codec(cls).to_wire(msg)
    return msgpack.packb({"type": cls.__name__, "version": PROTOCOL_VERSION, "body": body})


def decode(data: bytes) -> Any:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated exception types
        raise MessageError(f"not a msgpack message: {err}") from err
    if not isinstance(raw, dict) or raw.keys() != {"type", "version", "body"}:
        raise MessageError("a message is a map of exactly type, version and body")
    if raw["version"] != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {raw['version']!r}, expected {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(raw["type"]) if isinstance(raw["type"], str) else None
    if cls is None:
        raise MessageError(f"unknown message type {raw['type']!r}")
    msg = _codec(cls).from_wire(raw["body"])
    check = getattr(msg, "check", None)
    if check is not None:
        check()
    return msg


# --- per-class codecs, built once from the type hints ---
# A checker takes a decoded msgpack value and returns the field's value (raising MessageError);
# an encoder turns a field's value into msgpack-ready data. Both are closures made once per
# class, so that no message reflects on its type hints when it crosses the wire.

Checker = Callable[[Any], Any]


@dataclass(frozen=True)
class _Codec:
    from_wire: Callable[[Any], Any]
    to_wire: Callable[[Any], dict[str, Any]]


_CODECS: dict[type, _Codec] = {}


def _codec(cls: type) -> _Codec:
    codec = _CODECS.get(cls)
    if codec is None:
        codec = _CODECS[cls] = _make_codec(cls)
    return codec


def _make_codec(cls: type) -> _Codec:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = frozenset(f.name for f in fields)
    checks = [
        (
            f.name,
            _checker(hints[f.name], f"{cls.__name__}.{f.name}"),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in fields
    ]
    encoders = [(f.name, _encoder(hints[f.name])) for f in fields]

    def from_wire(body: Any) -> Any:
        if not isinstance(body, dict):
            raise MessageError(f"{cls.__name__} body must be a map")
        if not body.keys() <= names:
            unknown = sorted(set(body) - names, key=str)
            raise MessageError(f"{cls.__name__} has no field(s) {unknown}")
        values = {}
        for name, check, required in checks:
            if name in body:
                values[name] = check(body[name])
            elif required:
                raise MessageError(f"{cls.__name__} lacks field {name!r}")
        return cls(**values)

    def to_wire(msg: Any) -> dict[str, Any]:
        return {
            name: getattr(msg, name) if encode is None else encode(getattr(msg, name))
            for name, encode in encoders
        }

    return _Codec(from_wire, to_wire)


def _fail(where: str, expected: str, value: Any) -> typing.NoReturn:
    raise MessageError(f"{where}: expected {expected}, got {type(value).__name__}")


def _checker(hint: Any, where: str) -> Checker:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(option, where) for option in typing.get_args(hint)]

        def check_union(value: Any) -> Any:
            for option in options:
                try:
                    return option(value)
                except MessageError:
                    continue
            raise MessageError(f"{where}: {value!r} does not match {hint}")

        return check_union
    if hint is type(None):

        def check_none(value: Any) -> None:
            if value is not None:
                raise MessageError(f"{where}: expected None")

        return check_none
    if hint is Any:
        return lambda value: value
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        if item_hint is Any:

            def check_list(value: Any) -> list:
                if type(value) is not list:
                    _fail(where, "a list", value)
                return value

            return check_list
        if item_hint in (int, str, bool, bytes):
            # The hot path (token ids): one pass over the items, the list kept as it is.
            def check_plain_list(value: Any) -> list:
                if type(value) is not list or any(type(v) is not item_hint for v in value):
                    _fail(where, f"a list of {item_hint.__name__}", value)
                return value

            return check_plain_list
        item = _checker(item_hint, f"{where}[]")

        def check_items(value: Any) -> list:
            if type(value) is not list:
                _fail(where, "a list", value)
            return [item(v) for v in value]

        return check_items
    if origin is dict:

        def check_map(value: Any) -> dict:
            if not isinstance(value, dict):
                _fail(where, "a map", value)
            return value

        return check_map
    if dataclasses.is_dataclass(hint):
        return lambda value: _codec(hint).from_wire(value)
    if hint is float:

        def check_float(value: Any) -> float:
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            _fail(where, "float", value)

        return check_float
    if hint in (int, str, bool, bytes):
        # `type is`, not isinstance: a bool is not an int here.
        def check_plain(value: Any) -> Any:
            if type(value) is not hint:
                _fail(where, hint.__name__, value)
            return value

        return check_plain
    raise MessageError(f"{where}: unsupported field type {hint}")


def _encoder(hint: Any) -> Callable[[Any], Any] | None:
    """How a field of this type goes on the wire; None where it goes as it is (no message
    inside)."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return lambda value: _codec(hint).to_wire(value)
    if origin in (typing.Union, types.UnionType):
        if any(_encoder(option) for option in typing.get_args(hint)):
            return lambda value: _codec(type(value)).to_wire(value) if _is_message(value) else value
        return None
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _encoder(item_hint)
        if item is None:
            return None
        return lambda value: [item(v) for v in value]
    return None


def _is_message(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)
