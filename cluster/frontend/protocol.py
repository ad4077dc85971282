"""OpenAI response bodies and stream chunks (plain dicts), and the error body every failure carries.
Extension: `token_ids` in every response choice. The request bodies are in
cluster.frontend.request_schema.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel

from cluster.frontend.structured_output import ToolUse
from engine import TokenLogprob

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (documented in the OpenAPI schema)."""

    error: ErrorDetail


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
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        # OpenAI's shape: no content beside the calls, and the reason the answer ended.
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        finish_reason = "tool_calls"
    choice = {"index": index, "message": message, "finish_reason": finish_reason}
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
    index: int = 0,
) -> dict[str, Any]:
    """delta=None gives the usage-only chunk (no choices) that ends a stream with
    stream_options.include_usage."""
    choices = []
    if delta is not None:
        choices.append(
            {
                "index": index,
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
    index: int = 0,
) -> dict[str, Any]:
    """One response or one stream chunk (OpenAI uses the same object for both); text=None gives
    a usage-only chunk with no choices."""
    choices = []
    if text is not None:
        choices.append(
            {
                "index": index,
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
    """Turns deltas into one endpoint's response objects and stream chunks. A delta's choice is
    its `index` (cluster.frontend.choices.ChoiceDelta), 0 for a plain TokenDelta."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        backend: Any,
        include_usage: bool,
        tools: ToolUse | None = None,
    ) -> None:
        """`tools`: a chat request's tools, whose calls are read back from each answer; its
        stream then holds each choice's text back until it finishes, since only the whole
        answer tells whether it is a call."""
        self.chat = kind == "chat"
        self.tools = tools if self.chat else None
        self.held_text: dict[int, list[str]] = {}  # per choice, while `tools` holds text back
        self.request_id = request_id
        self.model = backend.model_name
        self.tokenizer = backend.tokenizer
        self.include_usage = include_usage
        self.created = now()
        self.chunks_sent: dict[int, int] = {}  # per choice
        # Per choice (completions with logprobs): where its next token's text starts.
        self.text_offset: dict[int, int] = {}

    def complete(self, results: list[Any], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The whole response, from everything collected for each choice (results[i]: choice
        i's)."""
        build = chat_completion if self.chat else text_completion
        bodies = [
            build(
                self.request_id,
                self.model,
                self.created,
                result.text,
                token_ids=result.token_ids,
                finish_reason=result.finish_reason,
                logprobs=self._logprobs(result.logprobs, 0),
                usage=usage,
                index=index,
                **self._tool_calls(result.text, result.finish_reason),
            )
            for index, result in enumerate(results)
        ]
        response = bodies[0]
        response["choices"] = [body["choices"][0] for body in bodies]
        return response

    def chunk(self, delta: Any) -> dict[str, Any]:
        """One stream chunk; the first chat chunk of each choice also carries the role."""
        index = getattr(delta, "index", 0)
        logprobs = self._logprobs(delta.logprobs, self.text_offset.get(index, 0))
        if logprobs is not None and not self.chat:
            # Where the next token's text starts: past this chunk's tokens' texts, as the
            # whole response counts them, however the tokens were grouped into chunks.
            self.text_offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        self.chunks_sent[index] = self.chunks_sent.get(index, 0) + 1
        finish_reason = delta.finish_reason
        if self.chat:
            content = {"role": "assistant"} if self.chunks_sent[index] == 1 else {}
            content["content"] = delta.text
            if self.tools is not None:
                content, finish_reason = self._held_back(index, content, finish_reason)
            build, payload = chat_chunk, content
        else:
            build, payload = text_completion, delta.text
        return build(
            self.request_id,
            self.model,
            self.created,
            payload,
            token_ids=delta.token_ids,
            finish_reason=finish_reason,
            logprobs=logprobs,
            index=index,
        )

    def _tool_calls(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        calls = self.tools.tool_calls(text, finish_reason) if self.tools is not None else None
        return {"tool_calls": calls} if calls else {}

    def _held_back(
        self, index: int, content: dict[str, Any], finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A chunk's delta while tools hold the text back: empty until the choice finishes,
        then its tool calls (each with its index, as OpenAI streams them) or its whole text."""
        held = self.held_text.setdefault(index, [])
        held.append(content["content"])
        if finish_reason is None:
            return {**content, "content": ""}, None
        text = "".join(held)
        calls = self._tool_calls(text, finish_reason).get("tool_calls")
        if not calls:
            return {**content, "content": text}, finish_reason
        streamed = [{"index": i, **call} for i, call in enumerate(calls)]
        return {k: v for k, v in content.items() if k == "role"} | {
            "tool_calls": streamed
        }, "tool_calls"

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
