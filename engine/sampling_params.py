"""Per-request sampling and stopping settings, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import RequestRejectedError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """`temperature=0` is greedy. `top_k=0` and `top_p=1` disable those filters. `logprobs=None`
    returns none, `0` the chosen token's, `n` also the n most likely tokens at each step."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            problems.append("stop strings must be non-empty strings")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            problems.append(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if problems:
            raise RequestRejectedError("; ".join(problems))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
