"""The wire format of the control plane's typed messages (metadata.messages,
metadata.stream_messages), encoded with msgpack (never pickle).

Every message is a frozen dataclass with a registered type name (`message`). On the wire it is a
msgpack map {"type": name, "version": PROTOCOL_VERSION, "body": {field: value}}; `decode` checks
the type, the version and every field's type, and raises MessageError on anything else; a class
with a `check` method has it called on every decoded message. Each class's decoder and encoder
are built once, on its first use, from its type hints: a message on the hot path (a node's
TokenFrame, every step) costs a pass over its fields, never a reflection."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
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
