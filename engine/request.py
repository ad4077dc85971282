"""A request's state inside one engine, and what the caller gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprob
from engine.sampling_params import SamplingParams


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
    finish_reason: str | None = None
    stopped_by_string: str | None = None
    error: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
