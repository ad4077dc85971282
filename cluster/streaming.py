"""Consuming a backend's deltas for the HTTP layer without ever leaking a request.

A request whose client went away must be aborted, so that its KV is freed: every path here ends
by closing the backend's async generator (which aborts an unfinished request), whether the
response completed, failed, or the client disconnected (before the first byte or mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.backend import BackendError, TokenDelta
from cluster.protocol import error_body
from engine import TokenLogprob

log = logging.getLogger("cluster.openai_api")

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the response started."""


@dataclass
class Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class ChunkFormatter(Protocol):
    def chunk(self, delta: TokenDelta) -> dict[str, Any]: ...
    def usage_chunk(self, usage: dict[str, Any] | None) -> dict[str, Any] | None: ...


def backend_error_body(err: BackendError) -> dict[str, Any]:
    kind = "service_unavailable_error" if err.status == 503 else "server_error"
    return error_body(str(err), type=kind, code=err.status)


def _ended_early() -> BackendError:
    return BackendError("the backend ended the stream without a finish reason", stage="stream")


async def collect_choices(deltas: AsyncIterator[TokenDelta], num_choices: int) -> list[Collected]:
    """Everything of each choice (deltas tagged with their choice's `index`, cluster.choices),
    until each has finished."""
    results = [Collected() for _ in range(num_choices)]
    pieces: list[list[str]] = [[] for _ in range(num_choices)]
    finished = 0
    async for delta in deltas:
        index = getattr(delta, "index", 0)
        result = results[index]
        pieces[index].append(delta.text)
        result.token_ids.extend(delta.token_ids)
        result.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            result.finish_reason, result.usage = delta.finish_reason, delta.usage
            finished += 1
            if finished == num_choices:
                break
    else:
        raise _ended_early()
    for result, texts in zip(results, pieces):
        result.text = "".join(texts)
    return results


async def next_delta(deltas: AsyncIterator[TokenDelta]) -> TokenDelta:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        raise _ended_early() from None


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect (or, once the
    # response is complete, a disconnect too).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it and raise ClientGone.
    Cancelling the task that iterates a backend generator closes the generator, which aborts
    the request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (watcher, task):
            pending.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """Streams SSE events while listening for the client going away, whatever the server's
    ASGI version (starlette only listens below spec 2.4, and uvicorn drops writes to a closed
    connection silently). Whichever ends first stops the other, and the event generator is
    always closed, so the backend's generator is closed and an unfinished request aborted.

    The stop is one plain asyncio cancellation, not an anyio cancel scope: a scope cancels
    every await until it exits, which would break a backend that awaits in its generator's
    `finally` (to send an abort message, say)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()

    async def _stream(self, send: Send) -> None:
        with contextlib.suppress(OSError):
            await self.stream_response(send)


def event_stream(
    first: TokenDelta,
    deltas: AsyncIterator[TokenDelta],
    formatter: ChunkFormatter,
    log_line: Callable[[str, int], None],
    num_choices: int = 1,
    total_usage: Callable[[list[dict[str, Any] | None]], dict[str, Any] | None] = lambda u: u[0],
) -> EventStreamResponse:
    """The SSE response for a stream whose first delta has arrived. With several choices the
    deltas carry their choice's `index` (cluster.choices), and the stream ends when each has
    finished; `total_usage` adds up their usages (by index) for the usage chunk. A failure
    after the first byte becomes a final `data: {"error": ...}` event, then `data: [DONE]`."""

    async def events() -> AsyncIterator[str]:
        delta, completion_tokens, outcome = first, 0, "client disconnected"
        usages: list[dict[str, Any] | None] = [None] * num_choices
        finished = 0
        try:
            while True:
                completion_tokens += len(delta.token_ids)
                yield sse(formatter.chunk(delta))
                if delta.finish_reason is not None:
                    usages[getattr(delta, "index", 0)] = delta.usage
                    finished += 1
                    if finished == num_choices:
                        break
                delta = await next_delta(deltas)
            outcome = f"finish={delta.finish_reason}"
            usage_chunk = formatter.usage_chunk(total_usage(usages))
            if usage_chunk is not None:
                yield sse(usage_chunk)
            yield DONE
        except Exception as err:
            if not isinstance(err, BackendError):
                log.exception("stream failed")
                err = BackendError(f"internal error: {err!r}", stage="stream")
            outcome = f"error: {err}"
            yield sse(backend_error_body(err))
            yield DONE
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            log_line(outcome, completion_tokens)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return EventStreamResponse(events(), headers=headers)
