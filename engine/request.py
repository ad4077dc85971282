"""A request's state inside one engine, and what the caller gets back."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.executor.prompt_embeds import PromptEmbeds
from engine.sampling.sampler import TokenLogprob
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.prefill_chunks import HeldChunks
from engine.tracing import RequestTrace

if TYPE_CHECKING:
    from engine.sampling.grammar import GrammarMatcher


@dataclass
class SpecStats:
    """Speculative decoding counters of one request. A verify step is a decode step that
    checked at least one draft token (none fit when max_tokens leaves room for one token only).
    A draft token counts as accepted when the target verified it and it became output (a stop
    condition can cut accepted drafts short); the rest of those proposed count as rejected."""

    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens committed by verify steps, bonus tokens included
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: draft j+1 accepted

    @property
    def rejected_tokens(self) -> int:
        return self.proposed_tokens - self.accepted_tokens

    @property
    def accept_length(self) -> float:
        """Tokens committed per verify step (1.0 means no draft token was ever accepted)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def add(self, other: SpecStats) -> None:
        """Add another request's counters to these (a node's totals)."""
        self.verify_steps += other.verify_steps
        self.proposed_tokens += other.proposed_tokens
        self.accepted_tokens += other.accepted_tokens
        self.emitted_tokens += other.emitted_tokens
        mine, theirs = self.accepted_per_position, other.accepted_per_position
        mine.extend([0] * (len(theirs) - len(mine)))
        for j, count in enumerate(theirs):
            mine[j] += count


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # KV bookkeeping: the request's row in the ReqToTokenPool and the slot of each cached token.
    row: int | None = None
    slots: list[int] = field(default_factory=list)
    kv_len: int = 0
    # The prefix cache's part of `slots`: the first `cached_len` belong to the cache
    # (engine.scheduling.prefix_cache), held through `cache_node` while the request reads them; the
    # rest are the request's own.
    cached_len: int = 0
    cache_node: Any = None
    # Prompt tokens whose KV the first prefill found cached (usage's cached_tokens).
    cached_tokens: int = 0
    finish_reason: str | None = None
    stopped_by_string: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Vectors given for some prompt positions in place of their tokens' embeddings; they stay
    # attached to those positions, so a re-prefill after preemption reads them again.
    prompt_embeds: PromptEmbeds | None = None
    # Speculative decoding: draft tokens each verify step checks (0: this request does not
    # speculate), the speculator's per-request state (engine code never looks inside it, since
    # spec depends on engine and not the reverse), and the counters.
    num_draft_tokens: int = 0
    spec_state: Any = None
    spec_stats: SpecStats | None = None
    # The request's timeline in this process; None unless the process traces (engine.tracing).
    trace: RequestTrace | None = None
    # Between the chunks of a prompt prefilled in chunks: what the draft's prefill will read
    # kept only for requests that speculate.
    held_chunks: HeldChunks | None = None
    # Parallel samples of this request's prompt that wait for its prefill: they take its prompt
    # KV (shared slots, engine.scheduling.kv_cache.KVCacheManager.fork) and sample their own first
    # token from its last logits instead of prefilling the prompt again.
    forks: list[Request] = field(default_factory=list)
    # The grammar state of a request whose params carry a grammar (engine.sampling.grammar).
    grammar: GrammarMatcher | None = None

    def commit(self, token: int) -> None:
        """Append a generated token; the grammar, if any, advances over it. Every place that
        commits a token goes through here, so the grammar never falls behind the output."""
        self.output_token_ids.append(token)
        if self.grammar is not None:
            self.grammar.advance(token)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list: a decode step reads one
        token of each request."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def newest_token_id(self) -> int:
        """`all_token_ids[-1]` without building the whole list."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def lookahead(self) -> int:
        """Draft tokens the next decode step verifies beyond the newest token. Never more than
        the request may still emit minus the bonus token, so a request's KV slots stay within
        prompt + max_tokens, which admission checked against the context and the pool."""
        remaining = self.params.max_tokens - len(self.output_token_ids) - 1
        # Comparisons, not min and max: every request's step reads this a few times.
        k = self.num_draft_tokens
        return k if k <= remaining else remaining if remaining > 0 else 0


@dataclass(frozen=True)
class CompletionTokensDetails:
    """OpenAI's names for speculative decoding's verified draft tokens."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Set only for requests that speculated.
    completion_tokens_details: CompletionTokensDetails | None = None
    spec_verify_steps: int | None = None
    spec_accept_length: float | None = None
    # [j]: verify steps that accepted draft token j+1 (the acceptance of each draft depth).
    spec_accepted_per_position: list[int] | None = None
    # Prompt tokens whose KV came from the prefix cache (OpenAI's
    # prompt_tokens_details.cached_tokens).
    cached_tokens: int = 0

    @classmethod
    def of(cls, req: Request) -> Usage:
        stats = req.spec_stats
        if stats is None:
            prompt, output = len(req.prompt_token_ids), len(req.output_token_ids)
            return cls(prompt, output, cached_tokens=req.cached_tokens)
        return cls(
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            CompletionTokensDetails(stats.accepted_tokens, stats.rejected_tokens),
            stats.verify_steps,
            stats.accept_length if stats.verify_steps else None,
            list(stats.accepted_per_position),
            req.cached_tokens,
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def spec_totals(usages: Iterable[Usage]) -> SpecStats:
    """The speculative counters of many requests' usage added up (those that speculated)."""
    total = SpecStats()
    for usage in usages:
        steps, details = usage.spec_verify_steps, usage.completion_tokens_details
        if not steps or details is None:
            continue
        accepted = details.accepted_prediction_tokens
        total.add(
            SpecStats(
                verify_steps=steps,
                proposed_tokens=accepted + details.rejected_prediction_tokens,
                accepted_tokens=accepted,
                emitted_tokens=round((usage.spec_accept_length or 0.0) * steps),
                accepted_per_position=list(usage.spec_accepted_per_position or []),
            )
        )
    return total


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    # (name, time_ns[, args]) events when the engine traces (engine.tracing), else None.
    trace: list[tuple[Any, ...]] | None = None
