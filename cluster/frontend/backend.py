"""The interface between the HTTP layer and whatever generates tokens.

`LocalBackend` (one in-process engine) and the disaggregated router both implement
`GenerationBackend`; `cluster.frontend.openai_api` serves either one unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engine import SamplingParams, TokenLogprob
from engine.executor.prompt_embeds import PromptEmbeds


@dataclass(frozen=True)
class TokenDelta:
    """One streamed piece of one request.

    `text` is safe to show: never a partial multi-byte character, never (part of) a stop string.
    A delta may carry tokens and no text (held back) or, on the last delta, text and no tokens
    (flushed). The last delta has `finish_reason` ("stop" | "length" | "abort") and `usage`
    (prompt_tokens, completion_tokens, total_tokens, plus any extra statistics, which the HTTP
    layer passes through unchanged).
    """

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # empty unless asked for
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class BackendError(Exception):
    """Generation failed after the request was accepted. The message names where it failed.

    `status` is the HTTP status the API answers with: 500 by default, 503 when the backend is
    overloaded or a node is unavailable (the client may retry).
    """

    def __init__(
        self, message: str, *, stage: str, node: str | None = None, status: int = 500
    ) -> None:
        where = f"{node}, {stage}" if node else stage
        super().__init__(f"{message} ({where})")
        self.message = message
        self.stage = stage
        self.node = node
        self.status = status


def make_usage(prompt_tokens: int, completion_tokens: int, **extra: Any) -> dict[str, Any]:
    """The `usage` dict of a final TokenDelta; `extra` holds backend-specific statistics."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        **extra,
    }


def cached_prompt_usage(cached_tokens: int | None) -> dict[str, Any]:
    """OpenAI's `prompt_tokens_details` for `usage`: the prompt tokens whose KV the serving
    engine's prefix cache held. Empty where that engine runs no prefix cache (None)."""
    if cached_tokens is None:
        return {}
    return {"prompt_tokens_details": {"cached_tokens": cached_tokens}}


@runtime_checkable
class GenerationBackend(Protocol):
    model_name: str
    max_model_len: int  # the longest prompt + max_tokens one request may have
    # Optional (read with getattr, default None): the most max_tokens one request may ask for
    # (--max-tokens-cap); a request that leaves max_tokens out gets it, as far as the context
    # allows.
    # max_tokens_cap: int | None
    tokenizer: Any  # a Hugging Face tokenizer: encode(), decode(), used by the HTTP layer

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """{"role", "content": str} messages -> prompt token ids ending where the answer starts."""
        ...

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        """Raise engine.RequestRejectedError if the request can never be served (for
        `prompt_embeds`: a width other than the model's hidden size, a position outside the
        prompt, a value that is not finite)."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """An async generator of deltas, the last one with finish_reason and usage; raises
        BackendError on failure. Closing it early (aclose, or cancelling the task iterating it)
        aborts the request and frees its KV on every node that holds it. `request_id` is unique
        among running requests. `prompt_embeds` replaces the embeddings of those prompt tokens
        (the HTTP layer passes it only when a request gives it). A backend that traces requests
        has a `traces` attribute (cluster.control.tracing.TraceStore) and takes `trace_events`, the
        (name, time_ns) events before the call (arrival, tokenized); the HTTP layer passes them
        only to such a backend."""
        ...

    async def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded" | "down", "nodes": [{"name", "status", ...}, ...]}"""
        ...
