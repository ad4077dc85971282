"""Typed control-plane messages, encoded with msgpack (never pickle).

Every message is a frozen dataclass with a registered type name. On the wire it is a msgpack map
{"type": name, "version": PROTOCOL_VERSION, "body": {field: value}}; `decode` checks the type, the
version and every field's type, and raises MessageError on anything else."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 3


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
    """Router -> decode node: preallocate for this request, then ask `prefill_node` to run it.
    `samples`: the prompt's other samples, which share its prefill (one prefill, one transfer
    of the prompt's target KV, forked slots on the decode node)."""

    room: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_node: int
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
    """Router -> decode node, decode node -> prefill node: stop the request, free its slots."""

    room: int


@message
class TokenUpdate:
    """Decode node -> router: new tokens of one request and, at the end, why it ended."""

    room: int
    token_ids: list[int]
    logprobs: list[list[Any]] = field(default_factory=list)  # [token, logprob, [[id, lp], ...]]
    finish_reason: str | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if _REGISTRY.get(name) is not type(msg):
        raise MessageError(f"{name} is not a registered message type")
    body = dataclasses.asdict(msg)
    return msgpack.packb({"type": name, "version": PROTOCOL_VERSION, "body": body})


def decode(data: bytes) -> Any:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated exception types
        raise MessageError(f"not a msgpack message: {err}") from err
    if not isinstance(raw, dict) or set(raw) != {"type", "version", "body"}:
        raise MessageError("a message is a map of exactly type, version and body")
    if raw["version"] != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {raw['version']!r}, expected {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(raw["type"])
    if cls is None:
        raise MessageError(f"unknown message type {raw['type']!r}")
    return _build(cls, raw["body"])


def _build(cls: type, body: Any) -> Any:
    if not isinstance(body, dict):
        raise MessageError(f"{cls.__name__} body must be a map")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(body) - set(fields)
    if unknown:
        raise MessageError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    values = {}
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{cls.__name__} lacks field {name!r}")
            continue
        values[name] = _check(hints[name], body[name], f"{cls.__name__}.{name}")
    return cls(**values)


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(option, value, where)
            except MessageError:
                continue
        raise MessageError(f"{where}: {value!r} does not match {hint}")
    if hint is type(None):
        if value is not None:
            raise MessageError(f"{where}: expected None")
        return None
    if hint is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_check(item, v, f"{where}[]") for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected a map")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bytes:
        if not isinstance(value, bytes):
            raise MessageError(f"{where}: expected bytes, got {type(value).__name__}")
        return value
    if hint in (int, str, bool, float):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise MessageError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    raise MessageError(f"{where}: unsupported field type {hint}")
