"""One benchmark request: a streaming POST to /v1/chat/completions or /v1/completions, timed
chunk by chunk, ending in a RequestResult whatever happens (see results.py for the outcomes).
Only cancellation escapes, so that an interrupted run can stop its requests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from cluster.bench_serving.datasets import BenchRequest
from cluster.bench_serving.results import Outcome, RequestResult
from cluster.bench_serving.stream_events import StreamEvent, Usage, parse_stream_line
from cluster.client_protocol import error_from_response

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class Target:
    """Where a run's requests go and what every one of them asks for."""

    base_url: str  # scheme://host:port, without /v1 (api_root)
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float | None = None  # per request, from send to the stream's end

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: BenchRequest) -> dict[str, Any]:
        if self.endpoint == "chat":
            body: dict[str, Any] = {"messages": request.chat_messages()}
        else:
            body = {"prompt": request.prompt}
        body |= {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            # An extension (vLLM, SGLang, pdcluster): sent only when asked, as OpenAI rejects it.
            body["ignore_eos"] = True
        return body


def api_root(url: str) -> str:
    """http://host:8000, http://host:8000/ and http://host:8000/v1 all name the same server."""
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def open_http_client(target: Target) -> httpx.AsyncClient:
    # No pool limit: a request waiting for a pooled connection would count the wait as latency.
    # No httpx timeout: Target.timeout_s bounds each request as a whole instead.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=target.base_url, timeout=None, limits=limits)


def first_served_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model GET /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{api_root(base_url)}/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as err:
        raise ConnectionError(f"could not list the models at {url}: {err!r}") from err
    if response.is_error:
        raise ConnectionError(f"GET {url} answered {error_from_response(response)}")
    models = response.json().get("data") or []
    if not models:
        raise ConnectionError(f"GET {url} lists no model; pass --model")
    return str(models[0]["id"])


class StreamClock:
    """The timings of one stream as its events arrive."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.first_content_at: float | None = None
        self.last_content_at: float | None = None
        self.gaps: list[float] = []
        self.content_chunks = 0
        self.finished = False  # [DONE] or a finish reason seen
        self.done_at: float | None = None
        self.usage: Usage | None = None
        self.texts: list[str] = []

    def observe(self, event: StreamEvent, now: float) -> None:
        if event.has_content:
            if self.last_content_at is None:
                self.first_content_at = now
            else:
                self.gaps.append(now - self.last_content_at)
            self.last_content_at = now
            self.content_chunks += 1
            self.texts.append(event.text)
        if event.usage is not None:
            self.usage = event.usage
        self.finished = self.finished or event.done or event.finish_reason is not None
        if event.done:
            self.done_at = now

    def result(
        self, index: int, request: BenchRequest, outcome: Outcome, error: str | None = None
    ) -> RequestResult:
        usage = self.usage or Usage(None, None)
        first = self.first_content_at
        ended_at = self.done_at or time.perf_counter()
        return RequestResult(
            index=index,
            outcome=outcome,
            sent_at=self.sent_at,
            prompt_tokens=usage.prompt_tokens or request.prompt_len,
            output_tokens=usage.completion_tokens or self.content_chunks,
            ttft_s=None if first is None else first - self.sent_at,
            itl_s=tuple(self.gaps),
            e2e_s=ended_at - self.sent_at,
            error=error,
            spec_accept_length=usage.spec_accept_length,
            spec_verify_steps=usage.spec_verify_steps,
            cached_tokens=usage.cached_tokens,
            output_text="".join(self.texts),
        )


async def send_request(
    http: httpx.AsyncClient, target: Target, request: BenchRequest, index: int
) -> RequestResult:
    clock = StreamClock(time.perf_counter())
    try:
        async with asyncio.timeout(target.timeout_s):
            return await _stream(http, target, request, index, clock)
    except TimeoutError:
        reason = f"no end within the {target.timeout_s:g} s timeout"
        return clock.result(index, request, Outcome.LOST, reason)
    except httpx.ConnectError as err:
        reason = f"could not connect to {target.base_url}: {err!r}"
        return clock.result(index, request, Outcome.FAILED, reason)
    except httpx.TransportError as err:
        reason = f"the connection broke before the stream ended: {err!r}"
        return clock.result(index, request, Outcome.LOST, reason)


async def _stream(
    http: httpx.AsyncClient,
    target: Target,
    request: BenchRequest,
    index: int,
    clock: StreamClock,
) -> RequestResult:
    body = target.body(request)
    async with http.stream("POST", target.path, json=body, headers=target.headers) as response:
        if response.is_error:
            await response.aread()
            return clock.result(index, request, Outcome.FAILED, str(error_from_response(response)))
        async for line in response.aiter_lines():
            try:
                event = parse_stream_line(line)
            except ValueError as err:
                reason = f"unreadable stream event: {err}"
                return clock.result(index, request, Outcome.FAILED, reason)
            if event is None:
                continue
            if event.error is not None:
                return clock.result(index, request, Outcome.FAILED, event.error)
            clock.observe(event, time.perf_counter())
            if event.done:
                break
    if clock.finished:
        return clock.result(index, request, Outcome.COMPLETED)
    reason = "the stream ended without [DONE] or a finish reason"
    return clock.result(index, request, Outcome.LOST, reason)
