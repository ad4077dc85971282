"""The thread that owns a LocalBackend's engine. EngineCore is not thread-safe, so one background
thread owns it: requests and aborts reach the thread through a queue (`submit`), the thread steps
the engine while there is work, and after each step it hands each request's new tokens, and the
text they complete (detokenized on that thread), to that request's asyncio.Queue on the event
loop (`RequestStream`), where the backend formats them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from cluster.frontend.backend import BackendError
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore
from engine.request import Request
from engine.sampling.sampler import TokenLogprob

log = logging.getLogger(__name__)

NODE_NAME = "local"


@dataclass(frozen=True)
class StepTokens:
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
class RequestStream:
    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer  # used by the engine thread only
    sent: int = 0  # output tokens already handed over

    def put(self, item: StepTokens | BackendError) -> bool:
        """False when the event loop is gone (nobody will ever read)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class EngineThread:
    def __init__(self, engine: EngineCore, stream_interval: int) -> None:
        """`stream_interval`: hand a request's tokens over once this many are new (its first
        and last at once)."""
        self.engine = engine
        self.stream_interval = stream_interval
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine thread only
        self._closed = False
        self._close_lock = threading.Lock()  # orders "submit" against "close + drain"
        self.stats = {"running": 0, "waiting": 0, "finished": 0, "aborted": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="local-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def submit(self, command: str, payload: Any, quiet: bool = False) -> None:
        """Queue "add" (a RequestStream), "add_samples" (a list of them) or "abort" (a request
        id) for the engine thread; once closed, raise a 503 unless `quiet`."""
        with self._close_lock:
            if not self._closed:
                self._inbox.put((command, payload))
                return
        if not quiet:
            raise BackendError(
                "the local engine is shut down", stage="admission", node=NODE_NAME, status=503
            )

    def close(self, timeout: float) -> None:
        """Stop the engine thread; running requests end with finish_reason "abort"."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(("stop", None))
        self._thread.join(timeout)

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

    def _add(self, stream: RequestStream) -> None:
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

    def _add_samples(self, streams: list[RequestStream]) -> None:
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
            self.stats["aborted"] += 1

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
                self.stats["finished" if request.finished else "aborted"] += 1
        self.stats["running"] = len(self.engine.scheduler.running)
        self.stats["waiting"] = len(self.engine.scheduler.waiting)

    def _publish(self, stream: RequestStream, finish_reason: str | None = None) -> bool:
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
        item = StepTokens(
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
            self.stats["failed"] += 1
        self._streams.clear()

    def _end_all(self) -> None:
        """On shutdown: abort what runs, and answer anything still queued."""
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            self._publish(stream, finish_reason="abort")
            self.stats["aborted"] += 1
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


def joined(items: list[StepTokens | BackendError]) -> StepTokens | BackendError:
    """The first of `items` and the tokens behind it, taken off the list as one: a reader that
    fell behind takes what waited for it at once. An error stays until the tokens before it
    are taken."""
    item = items.pop(0)
    while isinstance(item, StepTokens) and item.finish_reason is None and items:
        if isinstance(items[0], BackendError):
            break
        following = items.pop(0)
        item = StepTokens(
            item.token_ids + following.token_ids,
            item.text + following.text,
            item.logprobs + following.logprobs,
            following.finish_reason,
            following.num_prompt_tokens,
            following.num_output_tokens,
            following.num_cached_tokens,
        )
    return item
