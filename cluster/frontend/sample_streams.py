"""The streams of parallel samples that share one prefill of their prompt.

The samples go to the nodes as one request (one message names them all), yet each keeps a
stream of its own: its deltas, its failure, and its abort when closed. `SharedPrefill` opens the
request when the first of its streams is first read, leaving out the samples whose streams were
closed before; closing a stream later ends that sample's flight alone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Generic, TypeVar

from cluster.frontend.backend import TokenDelta

Flight = TypeVar("Flight")


class SharedPrefill(Generic[Flight]):
    def __init__(
        self,
        count: int,
        open_flights: Callable[[list[int]], Awaitable[list[Flight]]],
        next_delta: Callable[[Flight], Awaitable[TokenDelta]],
        end: Callable[[Flight], None],
        take_tokens: Callable[[Flight], TokenDelta | None] | None = None,
    ) -> None:
        """`open_flights(samples)`: send the request for these samples (their indices), one
        flight each; `next_delta(flight)`: its next delta (raises on failure); `end(flight)`:
        let go of it, aborting it unless it finished (idempotent); `take_tokens(flight)`: the
        delta `next_delta` would give at once when it holds tokens and no end, else None
        (without it, a stream cannot be listened to: `SampleStream.listen`)."""
        self._open_flights = open_flights
        self.next_delta = next_delta
        self.end = end
        self.take_tokens = take_tokens
        self.streams = [SampleStream(self, index) for index in range(count)]
        self._lock = asyncio.Lock()
        self._flights: dict[int, Flight] | None = None
        self._error: Exception | None = None
        self._closed: set[int] = set()

    async def flight(self, index: int) -> Flight:
        """Sample `index`'s flight, opening the request for every sample not closed yet."""
        async with self._lock:
            if self._flights is None and self._error is None:
                wanted = [i for i in range(len(self.streams)) if i not in self._closed]
                try:
                    self._flights = dict(zip(wanted, await self._open_flights(wanted)))
                except Exception as err:  # every sample's stream fails alike
                    self._error = err
        if self._error is not None:
            raise self._error
        assert self._flights is not None
        return self._flights[index]

    def close(self, index: int) -> None:
        self._closed.add(index)
        if self._flights is not None and index in self._flights:
            self.end(self._flights[index])


class SampleStream:
    """One sample's deltas, the last with its finish reason and usage (as
    `GenerationBackend.generate` gives them); `aclose` aborts the sample if unfinished."""

    def __init__(self, group: SharedPrefill, index: int) -> None:
        self._group = group
        self._index = index
        self._flight = None
        self._done = False

    def __aiter__(self) -> SampleStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._flight is None:
                self._flight = await self._group.flight(self._index)
            delta = await self._group.next_delta(self._flight)
        except BaseException:
            # Failed, or cancelled while waiting: as a generator's `finally` would.
            await self.aclose()
            raise
        if delta.finish_reason is not None:
            await self.aclose()
        return delta

    def listen(self, direct: Callable[[Callable[[], TokenDelta | None]], bool]) -> bool:
        """From now on, while this stream waits for its next delta, news of plain tokens goes
        to `direct(take)` first, at its delivery: `take()` gives the delta `__anext__` would
        (or None), and `direct` returns True when it took and handled it, False to have
        `__anext__` give it as usual. Ends and errors always come through `__anext__`. False
        when the stream cannot be listened to (not started, finished, or no `take_tokens`)."""
        take_tokens, flight = self._group.take_tokens, self._flight
        if take_tokens is None or flight is None or self._done:
            return False
        flight.listener = partial(direct, partial(take_tokens, flight))
        return True

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        self._group.close(self._index)
