"""OpenAI request bodies (pydantic) and response builders (plain dicts).

Requests are validated strictly: a string where a number belongs ("max_tokens": "10") is a 400,
as in the OpenAI API, rather than silently coerced; unknown fields are ignored. Extensions:
`top_k` and `ignore_eos` in requests, `prompt_embeds` in completion requests (vectors that replace
the embeddings of some prompt tokens), and `token_ids` in every response choice.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine import TokenLogprob

FinishReason = Literal["stop", "length", "abort"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """What both endpoints share. `model` may be left out: the served model is used."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Accepted so that clients which always send them at their neutral value keep working;
    # any other value is refused rather than silently ignored.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class PromptEmbedding(_Strict):
    """A vector given in place of the embedding of the prompt token at `position` (a position
    in the tokenized prompt; the token there stays as a placeholder)."""

    position: int
    embedding: list[float]


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: list[PromptEmbedding] | None = None


# ---- responses ---------------------------------------------------------------------------


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def now() -> int:
    return int(time.time())


def chat_completion(
    request_id: str,
    model: str,
    created: int,
    text: str,
    *,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
    usage: dict | None = None,
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": finish_reason}
    choice |= {"logprobs": logprobs, "token_ids": token_ids}
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    *,
    token_ids: list[int] | None = None,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    usage: dict | None = None,
) -> dict[str, Any]:
    """delta=None gives the usage-only chunk (no choices) that ends a stream with
    stream_options.include_usage."""
    choices = []
    if delta is not None:
        choices.append(
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
                "token_ids": token_ids or [],
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def text_completion(
    request_id: str,
    model: str,
    created: int,
    text: str | None,
    *,
    token_ids: list[int] | None = None,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    usage: dict | None = None,
) -> dict[str, Any]:
    """One response or one stream chunk (OpenAI uses the same object for both); text=None gives
    a usage-only chunk with no choices."""
    choices = []
    if text is not None:
        choices.append(
            {
                "index": 0,
                "text": text,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
                "token_ids": token_ids or [],
            }
        )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat format: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = _token_text(tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(tid, value) for tid, value in lp.top_logprobs],
            }
            for lp in logprobs
        ]
    }


def completion_logprobs(
    tokenizer: Any, logprobs: list[TokenLogprob], text_offset: int
) -> dict[str, Any]:
    """The legacy completions format: parallel lists; `text_offset` is where the first token's
    text starts in the completion."""
    tokens, offsets = [], []
    for lp in logprobs:
        token = _token_text(tokenizer, lp.token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {_token_text(tokenizer, tid): value for tid, value in lp.top_logprobs}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


class ResponseFormatter:
    """Turns deltas into one endpoint's response objects and stream chunks."""

    def __init__(self, kind: str, request_id: str, backend: Any, include_usage: bool) -> None:
        self.chat = kind == "chat"
        self.request_id = request_id
        self.model = backend.model_name
        self.tokenizer = backend.tokenizer
        self.include_usage = include_usage
        self.created = now()
        self.chunks_sent = 0
        self.text_offset = 0  # where the next chunk's text starts, for completion logprobs

    def complete(self, result: Any) -> dict[str, Any]:
        """The whole response, from everything collected."""
        build = chat_completion if self.chat else text_completion
        return build(
            self.request_id,
            self.model,
            self.created,
            result.text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            logprobs=self._logprobs(result.logprobs, 0),
            usage=result.usage,
        )

    def chunk(self, delta: Any) -> dict[str, Any]:
        """One stream chunk; the first chat chunk also carries the role."""
        logprobs = self._logprobs(delta.logprobs, self.text_offset)
        self.text_offset += len(delta.text)
        self.chunks_sent += 1
        if self.chat:
            content = {"role": "assistant"} if self.chunks_sent == 1 else {}
            content["content"] = delta.text
            build, payload = chat_chunk, content
        else:
            build, payload = text_completion, delta.text
        return build(
            self.request_id,
            self.model,
            self.created,
            payload,
            token_ids=delta.token_ids,
            finish_reason=delta.finish_reason,
            logprobs=logprobs,
        )

    def _logprobs(self, logprobs: list[TokenLogprob], text_offset: int) -> dict | None:
        if not logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, logprobs)
        return completion_logprobs(self.tokenizer, logprobs, text_offset)

    def usage_chunk(self, usage: dict[str, Any] | None) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        args = (self.request_id, self.model, self.created, None)
        return chat_chunk(*args, usage=usage) if self.chat else text_completion(*args, usage=usage)


# pydantic names the branches of a union in error locations ("stop", "list[str]"); they are
# types, not fields, so they are left out of `param`.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """pydantic errors -> (message, param): every problem with the first field that failed."""
    errors = list(errors)
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    if not _field_path(first.get("loc", ())):
        return f"the request body must be a JSON object: {first.get('msg')}", None
    param = _field_path(first["loc"])
    field = next(p for p in first["loc"] if p != "body")
    reasons = [
        f"{_field_path(e['loc'])}: {e['msg']}" for e in errors if field in e.get("loc", ())[:2]
    ]
    return f"invalid request: {'; '.join(dict.fromkeys(reasons))}", param


def _field_path(loc: Any) -> str:
    named = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int)
        or (p != "body" and "[" not in p and p.lower() not in _TYPE_NAMES and p.islower())
    ]
    return "".join(named).lstrip(".")
