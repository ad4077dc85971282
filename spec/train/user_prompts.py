"""Prompts a user brings (`--prompts FILE`): their user turns only, since the target writes the
answers. Two formats are read:

- ShareGPT JSON: a list of {"conversations": [{"from": "human" | "gpt" | "system",
  "value": "..."}, ...]};
- JSONL, one object a line: {"messages": [{"role": "system" | "user" | "assistant",
  "content": "..."}, ...]} or {"prompt": "..."}.

A file that is not one of them is refused with its path and the line of the fault. Empty
messages are left out, and a conversation with no user message left is skipped (and counted)."""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
JSONL_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}


class PromptFileError(ValueError):
    """A prompt file that is not ShareGPT JSON or chat JSONL; the message names path and line."""


@dataclass(frozen=True)
class UserConversation:
    """A conversation's user turns in order, under an optional system prompt; `line`: where it
    starts in its file."""

    user_turns: tuple[str, ...]
    system: str | None = None
    line: int = 0


@dataclass
class PromptFile:
    conversations: list[UserConversation] = field(default_factory=list)
    skipped: int = 0  # conversations with no user message


def normalised(text: str) -> str:
    """The text two messages that say the same thing share: Unicode compatibility forms folded,
    case folded, runs of white space made one space."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def read_prompt_file(path: str | Path) -> PromptFile:
    """The user conversations of a ShareGPT JSON or chat JSONL file (see the module's doc)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PromptFileError(f"{path}: cannot read the prompt file: {err}") from err
    if text.lstrip().startswith("["):
        items = _json_list_items(path, text)
        read = [_sharegpt(path, line, item) for line, item in items]
    else:
        read = []
        for number, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
            except ValueError as err:
                raise PromptFileError(f"{path}:{number}: not a JSON object: {err}") from err
            read.append(_jsonl(path, number, item))
    if not read:
        raise PromptFileError(f"{path}: holds no conversation")
    kept = [conversation for conversation in read if conversation is not None]
    return PromptFile(kept, len(read) - len(kept))


def _json_list_items(path: Path, text: str) -> list[tuple[int, Any]]:
    """The items of a JSON list with the line each starts on, decoded one by one so that a
    fault is reported where it is."""
    decoder = json.JSONDecoder()

    def fail(at: int, reason: str) -> PromptFileError:
        return PromptFileError(f"{path}:{text.count(chr(10), 0, at) + 1}: {reason}")

    def skip_space(at: int) -> int:
        while at < len(text) and text[at].isspace():
            at += 1
        return at

    items: list[tuple[int, Any]] = []
    at = skip_space(text.index("[") + 1)
    while at < len(text) and text[at] != "]":
        try:
            item, end = decoder.raw_decode(text, at)
        except ValueError as err:
            raise fail(err.pos if isinstance(err, json.JSONDecodeError) else at, str(err)) from err
        items.append((text.count("\n", 0, at) + 1, item))
        at = skip_space(end)
        if at < len(text) and text[at] == ",":
            at = skip_space(at + 1)
        elif at < len(text) and text[at] != "]":
            raise fail(at, "expected ',' or ']' between conversations")
    if at >= len(text):
        raise fail(len(text), "the list of conversations is not closed with ']'")
    if text[at + 1 :].strip():
        raise fail(at + 1, "text after the list of conversations")
    return items


def _sharegpt(path: Path, line: int, item: Any) -> UserConversation | None:
    where = f"{path}:{line}"
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        raise PromptFileError(f"{where}: a ShareGPT item is an object with a 'conversations' list")
    messages = []
    for turn, message in enumerate(item["conversations"], start=1):
        if not isinstance(message, dict) or not isinstance(message.get("value"), str):
            raise PromptFileError(f"{where}: turn {turn} is not {{'from': ..., 'value': text}}")
        role = SHAREGPT_ROLES.get(message.get("from"))
        if role is None:
            raise PromptFileError(
                f"{where}: turn {turn} is from {message.get('from')!r}; expected one of "
                f"{', '.join(SHAREGPT_ROLES)}"
            )
        messages.append((role, message["value"]))
    return _user_conversation(where, line, messages)


def _jsonl(path: Path, line: int, item: Any) -> UserConversation | None:
    where = f"{path}:{line}"
    if isinstance(item, dict) and "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise PromptFileError(f"{where}: 'prompt' must be text")
        return _user_conversation(where, line, [("user", item["prompt"])])
    if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
        raise PromptFileError(
            f"{where}: a JSONL line is an object with a 'messages' list or a 'prompt'"
        )
    messages = []
    for turn, message in enumerate(item["messages"], start=1):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise PromptFileError(
                f"{where}: message {turn} is not {{'role': ..., 'content': text}}"
            )
        role = JSONL_ROLES.get(message.get("role"))
        if role is None:
            raise PromptFileError(
                f"{where}: message {turn} has role {message.get('role')!r}; expected one of "
                f"{', '.join(JSONL_ROLES)}"
            )
        messages.append((role, message["content"]))
    return _user_conversation(where, line, messages)


def _user_conversation(
    where: str, line: int, messages: list[tuple[str, str]]
) -> UserConversation | None:
    system, users = None, []
    for role, content in messages:
        content = content.strip()
        if role == "system":
            if users:
                raise PromptFileError(f"{where}: a system message after a user message")
            system = content or None
        elif role == "user" and content:
            users.append(content)
    return UserConversation(tuple(users), system, line) if users else None
