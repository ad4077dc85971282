"""`LocalBackend`: one in-process engine behind the GenerationBackend interface.

EngineCore is not thread-safe, so one background thread owns it: requests and aborts reach the
thread through a queue, the thread steps the engine while there is work, and after each step it
hands each request's new tokens, and the text they complete (detokenized on that thread), to
that request's asyncio.Queue on the event loop, where they are formatted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cluster.backend import BackendError, TokenDelta, cached_prompt_usage, make_usage
from cluster.metrics import ClusterMetrics, RequestTimer
from engine import LLM, RequestRejectedError, SamplingParams, TokenLogprob
from engine.detokenizer import IncrementalDetokenizer
from engine.prompt_embeds import PromptEmbeds
from engine.request import Request

log = logging.getLogger(__name__)

NODE_NAME = "local"


@dataclass(frozen=True)
class _Tokens:
    """What the engine thread sends a request's stream after a step."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    # Prompt tokens the prefix cache held; None where the engine runs none.
    num_cached_tokens: int | None = None


@dataclass
class _Stream:
    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer  # used by the engine thread only
    sent: int = 0  # output tokens already handed over

    def put(self, item: _Tokens | BackendError) -> bool:
        """False when the event loop is gone (nobody will ever read)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class LocalBackend:
    def __init__(self, llm: LLM, model_name: str | None = None, stream_interval: int = 1) -> None:
        """`stream_interval`: hand a request's tokens over once this many are new (its first
        and last at once)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.model_name = model_name or llm.model_path.name
        # The engine refuses anything longer than either limit; report the tighter one.
        self.max_model_len = min(llm.config.max_model_len, llm.config.kv_cache_tokens)
        self.max_tokens_cap = llm.config.max_tokens_cap
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._closed = False
        self._close_lock = threading.Lock()  # orders "submit" against "close + drain"
        self._stats = {"running": 0, "waiting": 0, "finished": 0, "aborted": 0, "failed": 0}
        self.metrics = ClusterMetrics([_LocalNode(self)])
        self._thread = threading.Thread(target=self._run, name="local-engine", daemon=True)
        self._thread.start()

    # ---- GenerationBackend ----------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.llm.apply_chat_template(messages)

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        # make_request only reads the engine's fixed config, so it is safe off the thread.
        try:
            self.engine.make_request(
                "validate", prompt_token_ids, params, prompt_embeds=prompt_embeds
            )
        except RequestRejectedError:
            self.metrics.failure("rejected")
            raise

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> AsyncIterator[TokenDelta]:
        request = self.engine.make_request(
            request_id, prompt_token_ids, params, prompt_embeds=prompt_embeds
        )
        stream = self._stream(request)
        self._submit("add", stream)
        async for delta in self._deltas(stream, self.metrics.request()):
            yield delta

    def generate_samples(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        prompt_embeds: PromptEmbeds | None = None,
    ) -> list[AsyncIterator[TokenDelta]]:
        """Parallel samples of one prompt (`params[i]`: sample i's), each a stream as
        `generate` gives, that share one prefill of the prompt (EngineCore.add_samples). The
        samples join the engine together when the first stream is read; closing a stream
        aborts that sample alone."""
        requests = [
            self.engine.make_request(rid, prompt_token_ids, p, prompt_embeds=prompt_embeds)
            for rid, p in zip(request_ids, params, strict=True)
        ]
        group: list[_Stream] = []
        timers = self.metrics.samples(len(requests))

        async def sample(index: int) -> AsyncIterator[TokenDelta]:
            if not group:
                group.extend(self._stream(req) for req in requests)
                self._submit("add_samples", group)
            async for delta in self._deltas(group[index], timers[index]):
                yield delta

        return [sample(i) for i in range(len(requests))]

    def _stream(self, request: Request) -> _Stream:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.stop_strings)
        return _Stream(request, asyncio.get_running_loop(), asyncio.Queue(), detokenizer)

    async def _deltas(self, stream: _Stream, timer: RequestTimer) -> AsyncIterator[TokenDelta]:
        """The deltas of a request handed to the engine thread, until its last; closed early,
        the request is aborted."""
        request = stream.request
        finished = False
        try:
            waiting: list[_Tokens | BackendError] = []
            while not finished:
                if not waiting:
                    waiting.append(await stream.queue.get())
                while not stream.queue.empty():
                    waiting.append(stream.queue.get_nowait())
                item = _joined(waiting)
                if isinstance(item, BackendError):
                    finished = True  # the engine thread already dropped the request
                    timer.failed("error")
                    raise item
                timer.tokens(len(item.token_ids))
                usage = None
                if item.finish_reason is not None:
                    finished = True
                    usage = make_usage(
                        item.num_prompt_tokens,
                        item.num_output_tokens,
                        **cached_prompt_usage(item.num_cached_tokens),
                    )
                    timer.finished(item.finish_reason, usage)
                yield TokenDelta(
                    item.token_ids, item.text, item.logprobs, item.finish_reason, usage
                )
        finally:
            if not finished:
                timer.failed("aborted")
                # Closed early (client gone): free the request's KV. Never raises.
                self._submit("abort", request.request_id, quiet=True)

    async def health(self) -> dict[str, Any]:
        alive = self._thread.is_alive() and not self._closed
        node = {"name": NODE_NAME, "role": "aggregated", "status": "ok" if alive else "down"}
        node.update(self._stats)
        node["kv_free_slots"] = self.engine.kv_cache.num_free_slots
        return {"status": node["status"], "nodes": [node]}

    async def metrics_text(self) -> bytes:
        """Prometheus exposition: request latencies and the engine's load and KV usage."""
        return await self.metrics.render()

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; running requests end with finish_reason "abort"."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, command: str, payload: Any, quiet: bool = False) -> None:
        with self._close_lock:
            if not self._closed:
                self._inbox.put((command, payload))
                return
        if not quiet:
            raise BackendError(
                "the local engine is shut down", stage="admission", node=NODE_NAME, status=503
            )

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_work()):
                if self.engine.has_work():
                    self._step()
        except BaseException:
            log.exception("the local engine thread crashed")
            self._fail_all("the engine thread crashed")
        finally:
            with self._close_lock:
                self._closed = True
            self._end_all()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if the engine is idle); False on "stop"."""
        while True:
            try:
                command, payload = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                return False
            if command == "add":
                self._add(payload)
            elif command == "add_samples":
                self._add_samples(payload)
            elif command == "abort":
                self._abort(payload)

    def _add(self, stream: _Stream) -> None:
        request_id = stream.request.request_id
        if request_id in self._streams:
            stream.put(
                BackendError(
                    f"request id {request_id!r} is already running",
                    stage="admission",
                    node=NODE_NAME,
                )
            )
            return
        self._streams[request_id] = stream
        self.engine.add_request(stream.request)

    def _add_samples(self, streams: list[_Stream]) -> None:
        taken = [s for s in streams if s.request.request_id in self._streams]
        if taken:
            for stream in streams:
                stream.put(
                    BackendError(
                        f"request id {taken[0].request.request_id!r} is already running",
                        stage="admission",
                        node=NODE_NAME,
                    )
                )
            return
        for stream in streams:
            self._streams[stream.request.request_id] = stream
        self.engine.add_samples([stream.request for stream in streams])

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self._stats["aborted"] += 1

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as err:
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {err!r}")
            return
        for request_id, stream in list(self._streams.items()):
            request = stream.request
            new = len(request.output_token_ids) - stream.sent
            held = stream.sent and new < self.stream_interval
            if not request.finished and (not new or held):
                continue
            if not self._publish(stream) or request.finished:
                del self._streams[request_id]
                if not request.finished:  # the loop that would read it is gone
                    self.engine.abort(request_id)
                self._stats["finished" if request.finished else "aborted"] += 1
        self._stats["running"] = len(self.engine.scheduler.running)
        self._stats["waiting"] = len(self.engine.scheduler.waiting)

    def _publish(self, stream: _Stream, finish_reason: str | None = None) -> bool:
        request = stream.request
        end = len(request.output_token_ids)
        logprobs = (
            request.logprobs[stream.sent : end] if request.params.logprobs is not None else []
        )
        token_ids = request.output_token_ids[stream.sent : end]
        finish_reason = finish_reason or request.finish_reason
        text = stream.detokenizer.push(token_ids)
        if finish_reason is not None:
            text += stream.detokenizer.finish()
        item = _Tokens(
            token_ids=token_ids,
            text=text,
            logprobs=list(logprobs),
            finish_reason=finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=end,
            num_cached_tokens=(
                request.cached_tokens if self.engine.kv_cache.prefix_cache is not None else None
            ),
        )
        stream.sent = end
        return stream.put(item)

    def _fail_all(self, message: str) -> None:
        # After a failed step the engine's state is suspect: drop every request, each with a
        # terminal error, rather than let any wait forever.
        for request_id, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            stream.put(BackendError(message, stage="engine step", node=NODE_NAME))
            self._stats["failed"] += 1
        self._streams.clear()

    def _end_all(self) -> None:
        """On shutdown: abort what runs, and answer anything still queued."""
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            self._publish(stream, finish_reason="abort")
            self._stats["aborted"] += 1
        self._streams.clear()
        while True:
            try:
                command, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command not in ("add", "add_samples"):
                continue
            for stream in payload if command == "add_samples" else [payload]:
                stream.put(
                    BackendError(
                        "the local engine is shut down",
                        stage="admission",
                        node=NODE_NAME,
                        status=503,
                    )
                )


def _joined(items: list[_Tokens | BackendError]) -> _Tokens | BackendError:
    """The first of `items` and the tokens behind it, taken off the list as one: a reader that
    fell behind takes what waited for it at once. An error stays until the tokens before it
    are taken."""
    item = items.pop(0)
    while isinstance(item, _Tokens) and item.finish_reason is None and items:
        if isinstance(items[0], BackendError):
            break
        following = items.pop(0)
        item = _Tokens(
            item.token_ids + following.token_ids,
            item.text + following.text,
            item.logprobs + following.logprobs,
            following.finish_reason,
            following.num_prompt_tokens,
            following.num_output_tokens,
            following.num_cached_tokens,
        )
    return item


class _LocalNode:
    """The in-process engine as the metrics see a node."""

    name = NODE_NAME
    role = "aggregated"

    def __init__(self, backend: LocalBackend) -> None:
        self._backend = backend

    @property
    def alive(self) -> bool:
        return self._backend._thread.is_alive() and not self._backend._closed

    @property
    def in_flight(self) -> int:
        return len(self._backend._streams)

    async def stats(self) -> dict[str, Any]:
        # Sizes read off the engine thread: each is one atomic read, together a close snapshot.
        engine = self._backend.engine
        kv_cache = engine.kv_cache
        return {
            "running": len(engine.scheduler.running),
            "queued": len(engine.scheduler.waiting),
            "retractions": engine.scheduler.num_retractions,
            "kv_used": kv_cache.capacity - kv_cache.num_free_slots,
            "kv_capacity": kv_cache.capacity,
            "spec_plans": engine.plan_counts(),
            **kv_cache.prefix_cache_stats(),
        }
