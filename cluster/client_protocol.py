"""What the Python client sends and receives: typed results, errors, the SSE parser (no I/O)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx


class APIError(Exception):
    """The server answered with an error (status, and the OpenAI error body's fields)."""

    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.type, self.param = status, message, type, param


class APIConnectionError(Exception):
    """The server could not be reached, or the connection broke."""


class APITimeoutError(APIConnectionError):
    """No answer within the client's timeout."""


@dataclass(frozen=True)
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)  # server statistics beyond OpenAI's

    @classmethod
    def parse(cls, usage: dict[str, Any] | None) -> CompletionUsage | None:
        if not usage:
            return None
        known = ("prompt_tokens", "completion_tokens", "total_tokens")
        extra = {k: v for k, v in usage.items() if k not in known}
        return cls(*(int(usage.get(k) or 0) for k in known), extra=extra)


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    text: str
    token_ids: list[int] | None  # when the server provides them (pdcluster does)
    finish_reason: str | None
    usage: CompletionUsage | None
    logprobs: dict[str, Any] | None = None  # as the server sent it (chat or completions format)


@dataclass(frozen=True)
class CompletionChunk:
    text: str
    token_ids: list[int] | None
    finish_reason: str | None = None
    usage: CompletionUsage | None = None
    logprobs: dict[str, Any] | None = None


class WireFormat:
    """Request bodies and response parsing shared by Client and AsyncClient (no I/O)."""

    def __init__(self, base_url: str, api_key: str | None, model: str | None) -> None:
        base = base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model

    def body(self, stream: bool, **fields: Any) -> dict[str, Any]:
        body = {k: v for k, v in fields.items() if v is not None}
        if self.model is not None:
            body["model"] = self.model
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    @staticmethod
    def completion(payload: dict[str, Any]) -> Completion:
        choice = payload["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return Completion(
            id=payload.get("id", ""),
            model=payload.get("model", ""),
            text=text or "",
            token_ids=choice.get("token_ids"),
            finish_reason=choice.get("finish_reason"),
            usage=CompletionUsage.parse(payload.get("usage")),
            logprobs=choice.get("logprobs"),
        )

    @staticmethod
    def chunk(payload: dict[str, Any]) -> CompletionChunk:
        usage = CompletionUsage.parse(payload.get("usage"))
        if not payload.get("choices"):
            return CompletionChunk("", [], None, usage)
        choice = payload["choices"][0]
        text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        return CompletionChunk(
            text or "",
            choice.get("token_ids"),
            choice.get("finish_reason"),
            usage,
            choice.get("logprobs"),
        )


class StreamParser:
    """SSE lines -> chunks for one stream. Holds the finishing chunk back until the usage-only
    chunk after it arrives, so that the last chunk a caller sees has finish_reason and usage."""

    def __init__(self) -> None:
        self.held: CompletionChunk | None = None
        self.done = False

    def feed(self, line: str) -> list[CompletionChunk]:
        if not line.startswith("data:"):
            return []
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return self.flush()
        payload = json.loads(data)
        if "error" in payload:
            raise error_from_body(500, payload)
        chunk = WireFormat.chunk(payload)
        held = self.held
        if held is not None and not chunk.text and not chunk.token_ids and chunk.usage:
            self.held = None
            merged = CompletionChunk(
                held.text, held.token_ids, held.finish_reason, chunk.usage, held.logprobs
            )
            return [merged]
        ready = self.flush()
        if chunk.finish_reason is not None:
            self.held = chunk
        else:
            ready.append(chunk)
        return ready

    def flush(self) -> list[CompletionChunk]:
        held, self.held = self.held, None
        return [held] if held is not None else []


def error_from_body(status: int, payload: Any) -> APIError:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code")
        status = code if isinstance(code, int) and status == 500 else status
        return APIError(status, str(error.get("message")), error.get("type"), error.get("param"))
    detail = payload.get("detail") if isinstance(payload, dict) else payload
    return APIError(status, str(detail))


def error_from_response(response: httpx.Response) -> APIError:
    try:
        payload = response.json()
    except ValueError:
        payload = response.text or response.reason_phrase
    return error_from_body(response.status_code, payload)


@contextlib.contextmanager
def transport_errors() -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as err:
        raise APITimeoutError(f"request timed out: {err}") from err
    except httpx.TransportError as err:
        raise APIConnectionError(f"could not reach the server: {err!r}") from err


def wire_logit_bias(logit_bias: dict[int, float] | None) -> dict[str, float] | None:
    """JSON object keys are strings: the API takes token ids as such."""
    return None if logit_bias is None else {str(k): v for k, v in logit_bias.items()}


def completion_fields(
    prompt: str | list[int], max_tokens: int | None, logprobs: int | None, **common: Any
) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs, **common}


def chat_fields(
    messages: list[dict[str, Any]], max_tokens: int | None, logprobs: int | None, **common: Any
) -> dict[str, Any]:
    fields = {"messages": messages, "max_tokens": max_tokens, **common}
    if logprobs is not None:
        fields |= {"logprobs": True, "top_logprobs": logprobs}
    return fields
