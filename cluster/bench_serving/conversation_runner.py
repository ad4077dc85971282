"""One multi-turn run at one rate: conversations start on a Poisson arrival schedule (the rate
counts conversations per second; all at once for an infinite rate), at most `concurrency` of
them at a time, and each sends its turns one after another, every turn carrying the server's own
answers to the turns before it (as SGLang's multi-turn benchmark does). A conversation whose turn
did not complete ends there: its later turns would have no real answer to carry, and are never
sent.

Turn t of conversation c has the index (turns of the conversations before c) + t, the same at
every rate. Cancelling the run (Ctrl-C) counts the turns in flight as lost, as runner.py does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from cluster.bench_serving.datasets import BenchRequest, ConversationScript
from cluster.bench_serving.results import Outcome, RequestResult, RunResult
from cluster.bench_serving.runner import SendRequest, arrival_offsets


class Conversations:
    """The conversations a run has started, and every turn they sent."""

    def __init__(
        self,
        scripts: list[ConversationScript],
        send: SendRequest,
        tokenizer: Any,
        concurrency: int,
        progress: tqdm,
    ) -> None:
        self._scripts = scripts
        self._send = send
        self._tokenizer = tokenizer
        self._slots = asyncio.Semaphore(concurrency)
        self._progress = progress
        turns = [len(script.user_turns) for script in scripts]
        self._first_index = [0, *itertools.accumulate(turns)][:-1]
        self._tasks: list[asyncio.Task[None]] = []
        self._results: list[RequestResult] = []
        self._in_flight: dict[int, tuple[float, int]] = {}  # index: (sent_at, prompt tokens)

    def start(self, number: int) -> None:
        self._tasks.append(asyncio.create_task(self._converse(number)))

    async def _converse(self, number: int) -> None:
        script = self._scripts[number]
        answers: list[str] = []
        async with self._slots:
            for turn in range(len(script.user_turns)):
                request = script.turn_request(turn, answers, self._tokenizer)
                result = await self._send_turn(self._first_index[number] + turn, request)
                result = dataclasses.replace(result, turn=turn)
                self._results.append(result)
                self._progress.update()
                if result.outcome is not Outcome.COMPLETED:
                    self._progress.update(len(script.user_turns) - turn - 1)  # never sent
                    return
                answers.append(result.output_text)

    async def _send_turn(self, index: int, request: BenchRequest) -> RequestResult:
        sent_at = time.perf_counter()
        self._in_flight[index] = (sent_at, request.prompt_len)
        try:
            result = await self._send(request, index)
        except Exception as error:
            # A failure of the benchmark itself, kept as runner.py keeps it.
            reason = f"benchmark client error: {error!r}"
            result = RequestResult(index, Outcome.FAILED, sent_at, request.prompt_len, 0,
                                   error=reason)  # fmt: skip
        del self._in_flight[index]  # left in place when cancelled: counted as lost
        return result

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def results(self) -> list[RequestResult]:
        """Every sent turn in index order; call once every conversation is done or cancelled."""
        lost = [
            RequestResult.lost(index, sent_at, prompt_len, "cancelled: run interrupted")
            for index, (sent_at, prompt_len) in self._in_flight.items()
        ]
        return sorted(self._results + lost, key=lambda result: result.index)


async def run_conversations(
    scripts: list[ConversationScript],
    request_rate: float,
    send: SendRequest,
    tokenizer: Any,
    *,
    concurrency: int,
    seed: int = 0,
    show_progress: bool = True,
) -> RunResult:
    """Replay `scripts`; `tokenizer` sizes each turn's prompt where the server reports none."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    scheduled = sum(len(script.user_turns) for script in scripts)
    offsets = arrival_offsets(len(scripts), request_rate, np.random.default_rng(seed))
    progress = tqdm(
        total=scheduled, desc=f"rate {request_rate:g}/s", unit="turn", disable=not show_progress
    )
    conversations = Conversations(scripts, send, tokenizer, concurrency, progress)
    started_at = time.perf_counter()
    interrupted = False
    try:
        for number, offset in enumerate(offsets):
            delay = started_at + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            conversations.start(number)
        await conversations.wait()
    except asyncio.CancelledError:
        interrupted = True
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # handled by returning what was measured, as runner.py does
        await conversations.cancel()
    finally:
        progress.close()
    return RunResult(
        request_rate=request_rate,
        scheduled=scheduled,
        started_at=started_at,
        duration_s=time.perf_counter() - started_at,
        results=conversations.results(),
        interrupted=interrupted,
    )
