"""Typed reading of prompt_data.json, the word lists, templates and held-out prompts that
spec.train.prompts combines into chat prompts. They are data, kept out of the code that combines
them in a file shipped with the package (pyproject.toml package-data); each entry is read with
the type the prompts take it as, so a malformed entry fails at import, not while a training set
is being generated."""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files
from typing import Any


@cache
def _table() -> dict[str, Any]:
    text = files("spec.train").joinpath("prompt_data.json").read_text(encoding="utf-8")
    return json.loads(text)


def _entry(name: str, check, kind: str) -> list:
    value = _table()[name]
    if not isinstance(value, list) or not all(check(item) for item in value):
        raise ValueError(f"prompt_data.json: {name} is not a list of {kind}")
    return value


def _is_str(item: Any) -> bool:
    return isinstance(item, str)


def _is_strings(item: Any, width: int | None = None) -> bool:
    if not isinstance(item, list) or (width is not None and len(item) != width):
        return False
    return all(isinstance(s, str) for s in item)


def strings(name: str) -> list[str]:
    return list(_entry(name, _is_str, "strings"))


def pairs(name: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in _entry(name, lambda item: _is_strings(item, 2), "string pairs")]


def triples(name: str) -> list[tuple[str, str, str]]:
    items = _entry(name, lambda item: _is_strings(item, 3), "string triples")
    return [(a, b, c) for a, b, c in items]


def system_and_user(name: str) -> list[tuple[str | None, str]]:
    """(system prompt or None, user message) pairs."""
    items = _entry(name, _is_system_and_user, "(system or null, user) pairs")
    return [(system, user) for system, user in items]


def _is_system_and_user(item: Any) -> bool:
    return _is_strings(item, 2) or (_is_strings(item[1:], 1) and item[0] is None)


def templates_and_topics(name: str) -> list[tuple[list[str], list[str]]]:
    """(templates, the topics that fill their {t}) pairs."""
    items = _entry(
        name,
        lambda item: isinstance(item, list) and len(item) == 2 and all(map(_is_strings, item)),
        "(templates, topics) pairs",
    )
    return [(list(templates), list(topics)) for templates, topics in items]
