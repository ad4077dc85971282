"""What the Python client sends and receives: typed results, errors, the SSE parser (no I/O)."""

from __future__ import annotations

import contextlib
import dataclasses
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
    # Prompt tokens the server's prefix cache held (OpenAI's prompt_tokens_details); None where
    # it runs none. Left out of comparisons: it tells what the server had cached, not what it
    # answered, so two answers to one request compare equal whatever it held each time.
    cached_tokens: int | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, usage: dict[str, Any] | None) -> CompletionUsage | None:
        if not usage:
            return None
        known = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details")
        extra = {k: v for k, v in usage.items() if k not in known}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return cls(
            *(int(usage.get(k) or 0) for k in known[:3]),
            extra=extra,
            cached_tokens=None if cached is None else int(cached),
        )


@dataclass(frozen=True)
class Choice:
    """One choice of a response: choice `index` is prompt_index * n + sample_index."""

    index: int
    text: str
    token_ids: list[int] | None  # when the server provides them (pdcluster does)
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # as the server sent it (chat or completions format)
    # OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}] when the
    # answer is tool calls (finish_reason "tool_calls"; text is then empty).
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def parse(cls, choice: dict[str, Any]) -> Choice:
        message = choice.get("message") or {}
        text = message.get("content") if "message" in choice else choice.get("text")
        return cls(
            int(choice.get("index") or 0),
            text or "",
            choice.get("token_ids"),
            choice.get("finish_reason"),
            choice.get("logprobs"),
            message.get("tool_calls"),
        )


@dataclass(frozen=True)
class Completion:
    """A response. Its text, token ids, finish reason, logprobs and tool calls are choice 0's;
    `choices` holds every choice (n > 1, or several prompts), in index order."""

    id: str
    model: str
    text: str
    token_ids: list[int] | None  # when the server provides them (pdcluster does)
    finish_reason: str | None
    usage: CompletionUsage | None
    logprobs: dict[str, Any] | None = None  # as the server sent it (chat or completions format)
    tool_calls: list[dict[str, Any]] | None = None
    choices: list[Choice] = field(default_factory=list)


@dataclass(frozen=True)
class CompletionChunk:
    """A piece of choice `index`'s answer. Tool calls come whole, in the choice's last chunk,
    as OpenAI streams them ([{"index", "id", "type", "function"}])."""

    text: str
    token_ids: list[int] | None
    finish_reason: str | None = None
    usage: CompletionUsage | None = None
    logprobs: dict[str, Any] | None = None
    index: int = 0
    tool_calls: list[dict[str, Any]] | None = None


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
        choices = sorted((Choice.parse(c) for c in payload["choices"]), key=lambda c: c.index)
        first = choices[0]
        return Completion(
            id=payload.get("id", ""),
            model=payload.get("model", ""),
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            usage=CompletionUsage.parse(payload.get("usage")),
            logprobs=first.logprobs,
            tool_calls=first.tool_calls,
            choices=choices,
        )

    @staticmethod
    def chunk(payload: dict[str, Any]) -> CompletionChunk:
        usage = CompletionUsage.parse(payload.get("usage"))
        if not payload.get("choices"):
            return CompletionChunk("", [], None, usage)
        choice = payload["choices"][0]
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        return CompletionChunk(
            text or "",
            choice.get("token_ids"),
            choice.get("finish_reason"),
            usage,
            choice.get("logprobs"),
            int(choice.get("index") or 0),
            delta.get("tool_calls"),
        )


class StreamParser:
    """SSE lines -> chunks for one stream. Holds the finishing chunk back until the usage-only
    chunk after it arrives, so that the last chunk a caller sees has finish_reason and usage
    (with several choices, each choice's last chunk has its finish_reason, and the last of
    those the usage of the whole response)."""

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
            return [dataclasses.replace(held, usage=chunk.usage)]
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


Prompt = str | list[int] | list[str] | list[list[int]]


def completion_fields(
    prompt: Prompt, max_tokens: int | None, logprobs: int | None, **common: Any
) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs, **common}


def chat_fields(
    messages: list[dict[str, Any]], max_tokens: int | None, logprobs: int | None, **common: Any
) -> dict[str, Any]:
    fields = {"messages": messages, "max_tokens": max_tokens, **common}
    if logprobs is not None:
        fields |= {"logprobs": True, "top_logprobs": logprobs}
    return fields
