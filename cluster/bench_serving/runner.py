"""One run at one request rate: requests leave on a Poisson arrival schedule (all at once for an
infinite rate), at most `max_concurrency` at a time when set, with a progress bar.

Cancelling the run (Ctrl-C: asyncio.run cancels its main task) stops the schedule and cancels
the requests in flight; the run still returns what it measured, the cancelled requests counted
as lost. A request still waiting for a concurrency slot was never sent and is not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable

import numpy as np
from tqdm import tqdm

from cluster.bench_serving.datasets import BenchRequest
from cluster.bench_serving.results import Outcome, RequestResult, RunResult

SendRequest = Callable[[BenchRequest, int], Awaitable[RequestResult]]


def arrival_offsets(count: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """When each request is due, in seconds after the run starts: the first at once, then gaps
    drawn from an exponential distribution of mean 1 / rate. All at once for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"the request rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(count)
    gaps = rng.exponential(1.0 / request_rate, size=max(count - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:count]


class InFlight:
    """The requests a run has launched: which were sent, and what became of each."""

    def __init__(self, send: SendRequest, max_concurrency: int | None, progress: tqdm) -> None:
        self._send = send
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._progress = progress
        self._tasks: dict[int, asyncio.Task[RequestResult]] = {}
        self._requests: dict[int, BenchRequest] = {}
        self._sent_at: dict[int, float] = {}

    def launch(self, index: int, request: BenchRequest) -> None:
        task = asyncio.create_task(self._send_when_allowed(index, request))
        task.add_done_callback(lambda _: self._progress.update())
        self._tasks[index] = task
        self._requests[index] = request

    async def _send_when_allowed(self, index: int, request: BenchRequest) -> RequestResult:
        async with self._slots or contextlib.nullcontext():
            self._sent_at[index] = time.perf_counter()
            return await self._send(request, index)

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks.values())

    async def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def results(self) -> list[RequestResult]:
        """One result per sent request, in dataset order; call once every task is done."""
        return [
            self._result(index, task)
            for index, task in sorted(self._tasks.items())
            if index in self._sent_at
        ]

    def _result(self, index: int, task: asyncio.Task[RequestResult]) -> RequestResult:
        sent_at, prompt_len = self._sent_at[index], self._requests[index].prompt_len
        if task.cancelled():
            return RequestResult.lost(index, sent_at, prompt_len, "cancelled: run interrupted")
        error = task.exception()
        if error is not None:
            # A failure of the benchmark itself, not the server's: kept, so that every sent
            # request is still accounted for and the reason shows in the report.
            reason = f"benchmark client error: {error!r}"
            return RequestResult(index, Outcome.FAILED, sent_at, prompt_len, 0, error=reason)
        return task.result()


async def run_at_rate(
    requests: list[BenchRequest],
    request_rate: float,
    send: SendRequest,
    *,
    max_concurrency: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> RunResult:
    offsets = arrival_offsets(len(requests), request_rate, np.random.default_rng(seed))
    progress = tqdm(
        total=len(requests), desc=f"rate {request_rate:g}/s", unit="req", disable=not show_progress
    )
    flight = InFlight(send, max_concurrency, progress)
    started_at = time.perf_counter()
    interrupted = False
    try:
        for index, (request, offset) in enumerate(zip(requests, offsets, strict=True)):
            delay = started_at + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            flight.launch(index, request)
        await flight.wait()
    except asyncio.CancelledError:
        interrupted = True
        _consume_cancellation()
        await flight.cancel()
    finally:
        progress.close()
    return RunResult(
        request_rate=request_rate,
        scheduled=len(requests),
        started_at=started_at,
        duration_s=time.perf_counter() - started_at,
        results=flight.results(),
        interrupted=interrupted,
    )


def _consume_cancellation() -> None:
    """The run handles its cancellation by returning early: clear the request, so that the
    caller can still await the report's work (a second Ctrl-C aborts it)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
