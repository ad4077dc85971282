"""`LocalBackend`: one in-process engine behind the GenerationBackend interface. The engine is
stepped by a thread of its own (cluster.control.local_engine_thread); this side, on the event loop,
hands it requests and turns what it sends back into each request's stream of deltas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cluster.control.local_engine_thread import (
    NODE_NAME,
    EngineThread,
    RequestStream,
    StepTokens,
    joined,
)
from cluster.control.metrics import ClusterMetrics, RequestTimer
from cluster.frontend.backend import BackendError, TokenDelta, cached_prompt_usage, make_usage
from engine import LLM, RequestRejectedError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.executor.prompt_embeds import PromptEmbeds
from engine.request import Request


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
        self._thread = EngineThread(self.engine, stream_interval)
        self.metrics = ClusterMetrics([_LocalNode(self._thread)])

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
        self._thread.submit("add", stream)
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
        group: list[RequestStream] = []
        timers = self.metrics.samples(len(requests))

        async def sample(index: int) -> AsyncIterator[TokenDelta]:
            if not group:
                group.extend(self._stream(req) for req in requests)
                self._thread.submit("add_samples", group)
            async for delta in self._deltas(group[index], timers[index]):
                yield delta

        return [sample(i) for i in range(len(requests))]

    def _stream(self, request: Request) -> RequestStream:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.stop_strings)
        return RequestStream(request, asyncio.get_running_loop(), asyncio.Queue(), detokenizer)

    async def _deltas(
        self, stream: RequestStream, timer: RequestTimer
    ) -> AsyncIterator[TokenDelta]:
        """The deltas of a request handed to the engine thread, until its last; closed early,
        the request is aborted."""
        request = stream.request
        finished = False
        try:
            waiting: list[StepTokens | BackendError] = []
            while not finished:
                if not waiting:
                    waiting.append(await stream.queue.get())
                while not stream.queue.empty():
                    waiting.append(stream.queue.get_nowait())
                item = joined(waiting)
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
                self._thread.submit("abort", request.request_id, quiet=True)

    async def health(self) -> dict[str, Any]:
        alive = self._thread.alive
        node = {"name": NODE_NAME, "role": "aggregated", "status": "ok" if alive else "down"}
        node.update(self._thread.stats)
        node["kv_free_slots"] = self.engine.kv_cache.num_free_slots
        return {"status": node["status"], "nodes": [node]}

    async def metrics_text(self) -> bytes:
        """Prometheus exposition: request latencies and the engine's load and KV usage."""
        return await self.metrics.render()

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; running requests end with finish_reason "abort"."""
        self._thread.close(timeout)

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LocalNode:
    """The in-process engine as the metrics see a node."""

    name = NODE_NAME
    role = "aggregated"

    def __init__(self, thread: EngineThread) -> None:
        self._thread = thread

    @property
    def alive(self) -> bool:
        return self._thread.alive

    @property
    def in_flight(self) -> int:
        return self._thread.in_flight

    async def stats(self) -> dict[str, Any]:
        # Sizes read off the engine thread: each is one atomic read, together a close snapshot.
        engine = self._thread.engine
        kv_cache = engine.kv_cache
        return {
            "running": len(engine.scheduler.running),
            "queued": len(engine.scheduler.waiting),
            "retractions": engine.scheduler.num_retractions,
            "kv_used": kv_cache.capacity - kv_cache.num_free_slots,
            "kv_capacity": kv_cache.capacity,
            "spec_plans": engine.plan_counts(),
            "steps": engine.step_counts().as_dict(),
            **kv_cache.prefix_cache_stats(),
        }
