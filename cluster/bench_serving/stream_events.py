"""The events of an OpenAI-style SSE stream, as a benchmark sees them (no I/O).

The formats of pdcluster, vLLM and SGLang differ in details that matter here: a chat stream may
open with a role-only chunk (no content yet, so not the first token), reasoning models stream
`reasoning_content` before `content` (both are output), pdcluster's chunks carry `token_ids`
(content even when the detokenizer holds the text back), usage comes in a last chunk with no
choices, and an error after the first byte is a `data: {"error": ...}` event (older vLLM:
{"object": "error", "message": ...}). The answer's text is kept too (a conversation's next turn
carries it); reasoning text is not part of it, as chat clients leave it out of the history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.client_protocol import error_from_body


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    spec_accept_length: float | None = None  # pdcluster's speculative decoding statistics
    spec_verify_steps: int | None = None
    cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens (OpenAI's field)

    @classmethod
    def parse(cls, usage: dict[str, Any]) -> Usage:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=_optional(int, usage.get("prompt_tokens")),
            completion_tokens=_optional(int, usage.get("completion_tokens")),
            spec_accept_length=_optional(float, usage.get("spec_accept_length")),
            spec_verify_steps=_optional(int, usage.get("spec_verify_steps")),
            cached_tokens=_optional(int, cached),
        )


@dataclass(frozen=True)
class StreamEvent:
    done: bool = False  # data: [DONE]
    error: str | None = None
    has_content: bool = False  # carries output: text, reasoning text or token ids
    text: str = ""  # the answer's text in this chunk (chat: delta.content; completions: text)
    finish_reason: str | None = None
    usage: Usage | None = None


def parse_stream_line(line: str) -> StreamEvent | None:
    """The event of one `data:` line; None for the rest (blank separators, `: keep-alive`
    comments, `event:` lines). Raises ValueError on a data line that is not JSON."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return StreamEvent(done=True)
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise ValueError(f"a stream event must be a JSON object, got {data[:100]!r}")
    error = _error_text(payload)
    if error is not None:
        return StreamEvent(error=error)
    usage = payload.get("usage")
    choices = payload.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    delta = choice.get("delta") or {}
    return StreamEvent(
        has_content=_has_content(choice),
        text=delta.get("content") or choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        usage=Usage.parse(usage) if isinstance(usage, dict) else None,
    )


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    texts = (delta.get("content"), delta.get("reasoning_content"), choice.get("text"))
    return any(texts) or bool(choice.get("token_ids"))


def _error_text(payload: dict[str, Any]) -> str | None:
    if payload.get("object") == "error":
        payload = {"error": payload}
    if "error" not in payload:
        return None
    return f"stream error {error_from_body(500, payload)}"


def _optional(kind: type, value: Any) -> Any:
    return None if value is None else kind(value)
