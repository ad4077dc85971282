"""Consuming a backend's deltas for the HTTP layer without ever leaking a request.

A request whose client went away must be aborted, so that its KV is freed: every path here ends
by closing the backend's async generator (which aborts an unfinished request), whether the
response completed, failed, or the client disconnected (before the first byte or mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson
from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cluster.frontend.backend import BackendError, TokenDelta
from cluster.frontend.eager_send import send_eagerly
from cluster.frontend.protocol import error_body
from engine import TokenLogprob

log = logging.getLogger("cluster.frontend.openai_api")

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


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
    """Everything of each choice (deltas tagged with their choice's `index`,
    cluster.frontend.choices),
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


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event (UTF-8 JSON, as OpenAI's)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def coalesce(deltas: list[TokenDelta]) -> list[TokenDelta]:
    """The deltas of one write, each choice's (by `index`) joined into one, in the order the
    choices first appear: a client that fell behind gets what waited for it as one chunk."""
    if len(deltas) == 1:
        return deltas
    by_choice: dict[int, list[TokenDelta]] = {}
    for delta in deltas:
        by_choice.setdefault(getattr(delta, "index", 0), []).append(delta)
    return [joined(group) for group in by_choice.values()]


def joined(deltas: list[TokenDelta]) -> TokenDelta:
    """Consecutive deltas of one choice as one: their tokens, text and log-probabilities in
    order, and the last one's finish reason and usage."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return dataclasses.replace(
        last,
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        logprobs=[lp for d in deltas for lp in d.logprobs],
    )


HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The scope key under which the app puts the server's own `send`
# (cluster.frontend.openai_api.ApiApp).
RAW_SEND = "pdcluster.raw_send"


class EventStreamResponse(Response):
    """The SSE response for a stream whose first delta has arrived. Each write carries every
    delta ready at the time (`coalesce`), so a stream gets at most one write per node step, and
    a client that fell behind gets what waited for it at once. With several choices the deltas
    carry their choice's `index` (cluster.frontend.choices), and the stream ends when each has
    finished; `total_usage` adds up their usages (by index) for the usage chunk. A failure after the
    first byte becomes a final `data: {"error": ...}` event, then `data: [DONE]`.

    It listens for the client going away while it streams, whatever the server's ASGI version
    (starlette only listens below spec 2.4, and uvicorn drops writes to a closed connection
    silently). Whichever ends first stops the other, and the backend's deltas are always
    closed, so an unfinished request is aborted. The stop is one plain asyncio cancellation,
    not an anyio cancel scope: a scope cancels every await until it exits, which would break a
    backend that awaits in its generator's `finally` (to send an abort message, say).

    A lone choice whose deltas can be listened to (`listen`, cluster.frontend.sample_streams),
    served with the server's own `send` (RAW_SEND), has its plain tokens written by the call that
    delivers them (`_write_now`), the stream's task staying parked: a node's step then costs
    no task wake-up per stream. A write that has to wait for a slow client finishes in a task
    of its own; until it has, news wakes the stream's task, which waits for that write and
    sends everything gathered meanwhile as one chunk. Ends and errors take the task's way."""

    media_type = "text/event-stream"

    def __init__(
        self,
        first: TokenDelta,
        deltas: AsyncIterator[TokenDelta],
        formatter: ChunkFormatter,
        log_line: Callable[[str, int], None],
        num_choices: int = 1,
        total_usage: Callable[[list[dict[str, Any] | None]], dict[str, Any] | None] = (
            lambda usages: usages[0]
        ),
    ) -> None:
        # As StreamingResponse does: no body, so no Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers(HEADERS)
        self.first = first
        self.deltas = deltas
        self.formatter = formatter
        self.log_line = log_line
        self.num_choices = num_choices
        self.total_usage = total_usage
        self.completion_tokens = 0
        self._raw_send: Send | None = None
        # A `_write_now` still under way, and the news that waits for it.
        self._pending_write: asyncio.Future | None = None
        self._deferred_take: Callable[[], TokenDelta | None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_send = scope.get(RAW_SEND)
        # Only the server's own `send` may be run from a delivery's call (`_write_now`).
        if raw_send is not None and self.num_choices == 1:
            self._raw_send = raw_send
        stream = asyncio.ensure_future(self._stream(send, raw_send or send))
        listen = asyncio.ensure_future(_wait_for_disconnect_message(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self.deltas.aclose()  # type: ignore[attr-defined]
            self._deferred_take = None
            if self._pending_write is not None:
                self._pending_write.cancel()
                await asyncio.gather(self._pending_write, return_exceptions=True)
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()

    async def _stream(self, send: Send, raw_send: Send) -> None:
        """`send` starts the response, through the middlewares; `raw_send` (the server's own,
        where the app gives it) sends its body."""
        deltas, formatter = self.deltas, self.formatter
        take_next = deltas.__anext__
        ready = getattr(deltas, "ready", None)
        outcome = "client disconnected"
        usages: list[dict[str, Any] | None] = [None] * self.num_choices
        finished = 0
        try:
            await send(
                {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            )
            listen = getattr(deltas, "listen", None)
            if listen is not None and self._raw_send is not None:
                listen(self._write_now)
            batch = [self.first]
            while True:
                if ready is not None:
                    batch += ready()
                events = []
                for delta in coalesce(batch) if len(batch) > 1 else batch:
                    self.completion_tokens += len(delta.token_ids)
                    events.append(sse(formatter.chunk(delta)))
                    if delta.finish_reason is not None:
                        usages[getattr(delta, "index", 0)] = delta.usage
                        finished += 1
                if finished >= self.num_choices:
                    break
                await self._after_pending_write()
                await raw_send(
                    {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                )
                try:
                    batch = [await take_next()]
                except StopAsyncIteration:
                    raise _ended_early() from None
            outcome = f"finish={batch[-1].finish_reason}"
            usage_chunk = formatter.usage_chunk(self.total_usage(usages))
            if usage_chunk is not None:
                events.append(sse(usage_chunk))
            await self._after_pending_write()
            await _write(raw_send, b"".join(events) + DONE, more_body=False)
        except OSError:
            pass  # the client went away mid-write
        except Exception as err:
            if not isinstance(err, BackendError):
                log.exception("stream failed")
                err = BackendError(f"internal error: {err!r}", stage="stream")
            outcome = f"error: {err}"
            with contextlib.suppress(OSError):
                await self._after_pending_write()
                await _write(raw_send, sse(backend_error_body(err)) + DONE, more_body=False)
        finally:
            self.log_line(outcome, self.completion_tokens)

    def _write_now(self, take: Callable[[], TokenDelta | None]) -> bool:
        """Write the delta `take()` gives as its chunk, from the call that delivered it (the
        deltas' listener). While an earlier such write waits for the client, the news waits
        too, and goes out as one chunk when that write is done (`_write_deferred`). False,
        taking nothing, when there is nothing to take or an earlier write failed: the stream's
        task then takes the news, and meets the failure."""
        pending = self._pending_write
        if pending is not None:
            if not pending.done():
                self._deferred_take = take
                return True
            if pending.cancelled() or pending.exception() is not None:
                return False
            self._pending_write = None
        delta = take()
        if delta is None:
            return False
        self.completion_tokens += len(delta.token_ids)
        body = sse(self.formatter.chunk(delta))
        message = {"type": "http.response.body", "body": body, "more_body": True}
        pending = send_eagerly(self._raw_send, message)
        if pending is not None:
            self._pending_write = pending
            pending.add_done_callback(self._write_deferred)
        return True

    def _write_deferred(self, done: asyncio.Task) -> None:
        take, self._deferred_take = self._deferred_take, None
        if take is None or self._pending_write is not done:
            return
        if done.cancelled() or done.exception() is not None:
            return
        try:
            self._write_now(take)
        except Exception as err:  # noqa: BLE001 - the stream's task raises it at its next write
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(err)
            self._pending_write = failed

    async def _after_pending_write(self) -> None:
        """Wait for the `_write_now` writes still under way (raising what they raised), so
        that the stream's writes go out in order."""
        while (pending := self._pending_write) is not None:
            try:
                await pending
            finally:
                if self._pending_write is pending:
                    self._pending_write = None


async def _write(send: Send, body: bytes, more_body: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def _wait_for_disconnect_message(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def event_stream(
    first: TokenDelta,
    deltas: AsyncIterator[TokenDelta],
    formatter: ChunkFormatter,
    log_line: Callable[[str, int], None],
    num_choices: int = 1,
    total_usage: Callable[[list[dict[str, Any] | None]], dict[str, Any] | None] = lambda u: u[0],
) -> EventStreamResponse:
    return EventStreamResponse(first, deltas, formatter, log_line, num_choices, total_usage)
