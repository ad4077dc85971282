"""Several choices in one response: `n` samples of each prompt and batched prompts.

Choice `index` is prompt_index * n + sample_index, as in the OpenAI API, and sample s of a
prompt is generated with `params.for_sample(s)` (its own seed stream), as `engine.LLM` does,
so a seeded request gives the offline engine's choices. The samples of one prompt share one
prefill of it where the backend can (`shared_prefill_groups`, `generate_samples`), and are
requests of their own otherwise; every choice keeps a stream of its own, and their deltas are
merged as they come, each tagged with its index."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cluster.frontend.backend import BackendError, TokenDelta
from engine import SamplingParams
from engine.executor.prompt_embeds import PromptEmbeds


@dataclass(frozen=True)
class ChoiceRequest:
    """One choice: the backend request that generates sample `sample` of its prompt."""

    index: int
    sample: int
    prompt: list[int]
    params: SamplingParams
    prompt_embeds: PromptEmbeds | None = None


def choice_requests(
    prompts: list[list[int]], params: SamplingParams, embeds: list[PromptEmbeds | None]
) -> list[ChoiceRequest]:
    """Prompt-major: every sample of prompt 0, then of prompt 1, ..."""
    return [
        ChoiceRequest(i * params.n + s, s, prompt, params.for_sample(s), given)
        for i, (prompt, given) in enumerate(zip(prompts, embeds))
        for s in range(params.n)
    ]


def shared_prefill_groups(choices: list[ChoiceRequest]) -> list[list[ChoiceRequest]]:
    """The choices in order, grouped by prompt where the samples of a prompt may share one
    prefill; alone otherwise. Samples under a grammar do not share: each one's grammar state
    differs from its first token on, and the engines prefill such samples separately anyway."""
    groups: list[list[ChoiceRequest]] = []
    for choice in choices:
        shares = choice.sample > 0 and choice.params.grammar is None
        if shares and groups and groups[-1][0].prompt is choice.prompt:
            groups[-1].append(choice)
        else:
            groups.append([choice])
    return groups


@dataclass(frozen=True)
class ChoiceDelta(TokenDelta):
    """A delta of the choice `index`."""

    index: int = 0


_END = object()


class MergedChoices:
    """Every stream's deltas as they arrive, tagged with the stream's index, until every stream
    gave its last delta (the one with a finish reason). A stream that fails ends the merge with
    its error; closing the merge closes every stream, aborting the unfinished requests. `ready`
    takes what has arrived without waiting, so that a writer sends it in one go."""

    def __init__(self, streams: list[AsyncIterator[TokenDelta]]) -> None:
        self._streams = streams
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._running = len(streams)
        self._error: Exception | None = None
        self._closed = False
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[TokenDelta]) -> None:
        queue = self._queue
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
                if delta.finish_reason is not None:
                    queue.put_nowait((index, _END))
                    return
            queue.put_nowait((index, _ended_early()))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, err))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def __aiter__(self) -> MergedChoices:
        return self

    async def __anext__(self) -> ChoiceDelta:
        while True:
            if self._error is not None:
                raise self._error
            if not self._running:
                raise StopAsyncIteration
            delta = self._take(*await self._queue.get())
            if delta is not None:
                return delta

    def ready(self) -> list[ChoiceDelta]:
        deltas = []
        while self._error is None and not self._queue.empty():
            delta = self._take(*self._queue.get_nowait())
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _take(self, index: int, item: Any) -> ChoiceDelta | None:
        if item is _END:
            self._running -= 1
            return None
        if isinstance(item, Exception):
            self._error = item
            return None
        return ChoiceDelta(**vars(item), index=index)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # A pump cancelled before it ran never closed its stream.
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]


def merge_choices(streams: list[AsyncIterator[TokenDelta]]) -> MergedChoices:
    return MergedChoices(streams)


def total_usage(usages: list[dict[str, Any] | None], requests: list[ChoiceRequest]) -> dict:
    """The response's usage: every choice's completion tokens, every prompt's tokens (and its
    cached tokens) once, and the speculative counts (completion_tokens_details) added up."""
    if len(usages) == 1 and usages[0] is not None:
        return usages[0]
    # A prompt is read by each of its samples but counted once, as OpenAI does.
    prompt = sum(u["prompt_tokens"] for u, r in zip(usages, requests) if u and r.sample == 0)
    completion = sum(u["completion_tokens"] for u in usages if u)
    total: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    firsts = [u for u, r in zip(usages, requests) if u and r.sample == 0]
    cached = [u["prompt_tokens_details"] for u in firsts if "prompt_tokens_details" in u]
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": sum(d["cached_tokens"] for d in cached)}
    details = [u.get("completion_tokens_details") for u in usages if u]
    details = [d for d in details if d]
    if details:
        total["completion_tokens_details"] = {
            key: sum(d.get(key) or 0 for d in details)
            for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")
        }
    return total


def _ended_early() -> BackendError:
    return BackendError("the backend ended the stream without a finish reason", stage="stream")
