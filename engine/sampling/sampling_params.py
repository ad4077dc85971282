"""Per-request sampling and stopping settings, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from engine.errors import RequestRejectedError

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_SAMPLES = 128

LogitBias = Mapping[int, float] | Sequence[Sequence[float]]


@dataclass(frozen=True)
class SamplingParams:
    """`temperature=0` is greedy. `top_k=0` and `top_p=1` disable those filters. `logprobs=None`
    returns none, `0` the chosen token's, `n` also the n most likely tokens at each step.

    Logits processors, applied before temperature, top-k and top-p
    (engine.sampling.logits_processors): `presence_penalty` and `frequency_penalty` (OpenAI's, over
    generated tokens), `repetition_penalty` (transformers': over prompt and generated tokens, 1
    disables it), `logit_bias` ({token id: bias in [-100, 100]}, or (id, bias) pairs), and
    `min_tokens` (end-of-sequence and stop tokens masked until that many tokens were generated).
    `n` samples are generated for each prompt; sample i draws from `for_sample(i)`.
    `grammar`: llguidance grammar text (engine.sampling.grammar) that every generated token must
    follow: structured output. Plain text, so that it crosses to the nodes as it is."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: LogitBias = ()
    min_tokens: int = 0
    n: int = 1
    grammar: str | None = None

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
        problems += self._processor_problems()
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            problems.append(f"n must be in [1, {MAX_SAMPLES}], got {self.n!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            problems.append("grammar must be a non-empty string (engine.sampling.grammar)")
        if problems:
            raise RequestRejectedError("; ".join(problems))

    def _processor_problems(self) -> list[str]:
        problems = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2 <= value <= 2:
                problems.append(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            problems.append(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            problems.append(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be non-negative integers")
        try:
            biases = self.logit_bias_items
        except (TypeError, ValueError):
            return [*problems, "logit_bias must map token ids to numbers"]
        if any(not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS for _, b in biases):
            problems.append(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        if any(t < 0 for t, _ in biases):
            problems.append("logit_bias keys must be non-negative token ids")
        return problems

    @property
    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, whichever form `logit_bias` was given in."""
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        items = []
        for token, bias in pairs:
            if isinstance(token, bool) or int(token) != token:
                raise ValueError(f"logit_bias key {token!r} is not a token id")
            items.append((int(token), float(bias)))
        return tuple(items)

    @property
    def penalized(self) -> bool:
        """The logits need processing before sampling (engine.sampling.logits_processors)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of `n`: one sample each. Sample 0 keeps the seed,
        so n=1 draws what it always drew; sample i > 0 draws from a seed derived from
        (seed, i) alone, so a seeded request gives the same n samples every time, and they
        differ from each other."""
        if self.seed is None or index == 0:
            return replace(self, n=1)
        return replace(self, n=1, seed=derived_seed(self.seed, index))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def derived_seed(seed: int, index: int) -> int:
    """A seed for sample `index` of a request seeded with `seed`: splitmix64 of the pair, kept
    non-negative and below 2**63 so it stays a signed 64-bit integer on the wire."""
    z = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 1
