"""The admission gate of the HTTP API: the one place that decides whether a generation request
may start, and that ends the ones that may not go on. The HTTP layer consults it for every
backend alike (the router, LocalBackend), so no backend knows about it.

A request is in flight from the moment it is admitted (before its prompt is tokenized) until
its response is complete, streamed or not: waiting for a batch slot counts, generating counts.

- Draining (`begin_drain`, after SIGTERM or a first Ctrl-C): every new request is refused with
  a 503 and Retry-After, and /health answers 503 so that load balancers stop sending; the
  requests in flight run on. `drain` waits for them up to the drain timeout, then ends the rest
  with an error naming the drain.
- Full (`max_queued_requests`): a request arriving while that many are in flight is refused at
  once with a 429 and Retry-After, instead of waiting in a queue without bound.
- Queue timeout (`queue_timeout_s`): a request with no first token that long after its arrival
  ends with an error naming the timeout (a 503 when nothing was streamed yet).

A request is ended by closing the backend's generator, which aborts it and frees its KV on
every node that holds it (GenerationBackend.generate). Everything here runs on the HTTP
server's event loop, except `begin_drain` and the properties, which any thread may call.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable

from cluster.frontend.api_errors import OpenAIError
from cluster.frontend.backend import BackendError, TokenDelta

# A slot frees as soon as any request in flight ends: a full server is worth retrying soon.
FULL_RETRY_AFTER_S = 1
# After the drain timeout ends the last requests, how long they get to send their final error.
END_GRACE_S = 5.0


class Admission:
    def __init__(
        self, max_queued_requests: int | None = None, queue_timeout_s: float | None = None
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be positive, got {max_queued_requests}")
        if queue_timeout_s is not None and not queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be positive, got {queue_timeout_s}")
        self.max_queued_requests = max_queued_requests
        self.queue_timeout_s = queue_timeout_s
        self._admitted: set[AdmittedRequest] = set()
        self._released = asyncio.Event()
        self._drain_ends_at: float | None = None  # time.monotonic()
        self._drain_timeout_s = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._admitted)

    @property
    def draining(self) -> bool:
        return self._drain_ends_at is not None

    def drain_left_s(self) -> float:
        """Seconds until the drain ends the requests still running (0 when not draining)."""
        if self._drain_ends_at is None:
            return 0.0
        return max(0.0, self._drain_ends_at - time.monotonic())

    def admit(self) -> AdmittedRequest:
        """Admit one generation request, or raise the OpenAIError that refuses it."""
        if self.draining:
            left = max(1, math.ceil(self.drain_left_s()))
            raise OpenAIError(
                503,
                f"the server is draining: it stops within {left} s; retry on another replica",
                type="service_unavailable_error",
                code="draining",
                headers={"Retry-After": str(left)},
                failure="overloaded",
            )
        if self.max_queued_requests is not None and self.in_flight >= self.max_queued_requests:
            raise OpenAIError(
                429,
                f"the server is full: {self.in_flight} requests in flight, the limit "
                f"(--max-queued-requests) is {self.max_queued_requests}; retry later",
                type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": str(FULL_RETRY_AFTER_S)},
                failure="overloaded",
            )
        loop = asyncio.get_running_loop()
        first_token_deadline = (
            None if self.queue_timeout_s is None else loop.time() + self.queue_timeout_s
        )
        admitted = AdmittedRequest(self, first_token_deadline)
        self._admitted.add(admitted)
        return admitted

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests from now on; those in flight get `timeout_s` to finish.
        Safe from any thread; a second call keeps the first deadline."""
        if self._drain_ends_at is None:
            self._drain_timeout_s = timeout_s
            self._drain_ends_at = time.monotonic() + timeout_s

    async def drain(self, timeout_s: float) -> int:
        """Begin the drain, wait for the requests in flight to finish, end those left at the
        timeout with an error naming the drain; the number ended that way."""
        self.begin_drain(timeout_s)
        if await self.wait_until_idle(self.drain_left_s()):
            return 0
        ended = self.end_all(
            BackendError(
                f"the server is shutting down and the drain timeout of "
                f"{self._drain_timeout_s:g} s (--drain-timeout) ended this request",
                stage="drain",
                status=503,
            )
        )
        await self.wait_until_idle(END_GRACE_S)
        return ended

    async def wait_until_idle(self, timeout_s: float) -> bool:
        """Whether no request was in flight within `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._admitted:
                    self._released.clear()
                    await self._released.wait()
        return not self._admitted

    def end_all(self, error: BackendError) -> int:
        """End every request in flight with `error`; how many there were."""
        admitted = list(self._admitted)
        for request in admitted:
            request.end(error)
        return len(admitted)

    def _release(self, request: AdmittedRequest) -> None:
        self._admitted.discard(request)
        self._released.set()


class AdmittedRequest:
    """One request in flight: `watch` its backend's deltas, and `release` it when its response
    is complete (closing the watched deltas releases it too; releasing twice does nothing)."""

    def __init__(self, admission: Admission, first_token_deadline: float | None) -> None:
        self._admission = admission
        self.first_token_deadline = first_token_deadline  # the event loop's time()
        self.ended_by: BackendError | None = None
        # While awaiting the backend: the deadline's timeout before the first token, the
        # waiting task after it (a timeout per delta would cost more than the delta).
        self._timeout: asyncio.Timeout | None = None
        self._waiting: asyncio.Task | None = None

    def watch(self, deltas: AsyncIterator[TokenDelta]) -> WatchedDeltas:
        return WatchedDeltas(self, deltas)

    def end(self, error: BackendError) -> None:
        """End the request with `error` at its next (or current) wait for the backend."""
        self.ended_by = error
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())
        elif self._waiting is not None:
            self._waiting.cancel()

    def release(self) -> None:
        self._admission._release(self)

    def queue_timeout_error(self) -> BackendError:
        return BackendError(
            f"no first token within the queue timeout of {self._admission.queue_timeout_s:g} s "
            f"(--queue-timeout): the server is busy; retry later",
            stage="queue",
            status=503,
        )


class WatchedDeltas:
    """A backend's deltas that end, the backend's generator closed, when the request is ended
    or gets no first token by its deadline."""

    def __init__(self, request: AdmittedRequest, deltas: AsyncIterator[TokenDelta]) -> None:
        self._request = request
        self._deltas = deltas
        self._first_token_seen = False

    def __aiter__(self) -> WatchedDeltas:
        return self

    async def __anext__(self) -> TokenDelta:
        request = self._request
        if request.ended_by is not None:
            await self.aclose()
            raise request.ended_by
        if self._first_token_seen or request.first_token_deadline is None:
            # Without a deadline (the stream's every delta after the first): `end` cancels
            # the waiting task instead; a timeout per delta would cost more than the delta.
            task = asyncio.current_task()
            request._waiting = task
            try:
                delta = await self._deltas.__anext__()
            except asyncio.CancelledError:
                # That cancel is this gate's (`end`), unless another one is pending too.
                if request.ended_by is None or task.uncancel() > 0:
                    raise
                await self.aclose()
                raise request.ended_by from None
            finally:
                request._waiting = None
            if not self._first_token_seen and (delta.token_ids or delta.finish_reason):
                self._first_token_seen = True
            return delta
        deadline = request.first_token_deadline
        try:
            # Cancelling the wait cancels the backend's generator where it awaits: that aborts
            # the request, as a client going away does.
            async with asyncio.timeout_at(deadline) as timeout:
                request._timeout = timeout
                delta = await anext(self._deltas)
        except TimeoutError:
            if not timeout.expired():
                raise  # the backend's own, not a deadline of this gate
            await self.aclose()
            raise request.ended_by or request.queue_timeout_error() from None
        finally:
            request._timeout = None
        if delta.token_ids or delta.finish_reason is not None:
            self._first_token_seen = True
        return delta

    def ready(self) -> list[TokenDelta]:
        """The deltas the backend holds ready now (none where it cannot tell)."""
        ready = getattr(self._deltas, "ready", None)
        if ready is None or self._request.ended_by is not None:
            return []
        deltas = ready()
        if any(d.token_ids or d.finish_reason is not None for d in deltas):
            self._first_token_seen = True
        return deltas

    def listen(self, direct: Callable[[Callable[[], TokenDelta | None]], bool]) -> bool:
        """The backend's `listen` (cluster.frontend.sample_streams.SampleStream), where it has one,
        declined once the request is ended or before its first token (news must then wake
        `__anext__`, which ends it or lets its deadline go)."""
        listen = getattr(self._deltas, "listen", None)
        if listen is None:
            return False
        request = self._request

        def gated(take: Callable[[], TokenDelta | None]) -> bool:
            if request.ended_by is not None or not self._first_token_seen:
                return False
            return direct(take)

        return listen(gated)

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()  # type: ignore[attr-defined]
        finally:
            self._request.release()
