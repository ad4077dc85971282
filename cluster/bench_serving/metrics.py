"""A run's numbers, from its requests' results (pure functions, no I/O).

Latencies and throughputs count completed requests only: a failed or lost request has no
meaningful latency, and its tokens were not all served. Percentiles interpolate linearly between
samples (numpy's default), as vLLM's and SGLang's benchmarks do. ITL statistics pool the gaps of
every completed request. The cached share counts the requests whose usage reports
`prompt_tokens_details.cached_tokens`: their cached prompt tokens over their prompt tokens (None
when no request reports it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.bench_serving.results import Outcome, RequestResult, RunResult, rate_to_json

ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles in milliseconds; None without samples."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if len(seconds) == 0:
            return cls()
        values = np.asarray(seconds, dtype=float) * 1000.0
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(*(round(float(v), 3) for v in (values.mean(), p50, p90, p99)))

    def to_json(self) -> dict[str, float | None]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}


@dataclass(frozen=True)
class Slo:
    """Latency targets; a request is good when it meets every target given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def is_met_by(self, result: RequestResult) -> bool:
        if result.outcome is not Outcome.COMPLETED:
            return False
        if self.ttft_ms is not None:
            if result.ttft_s is None or result.ttft_s * 1000.0 > self.ttft_ms:
                return False
        # An answer of one token has no time per output token: nothing to miss.
        tpot = result.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000.0 <= self.tpot_ms


@dataclass(frozen=True)
class RunSummary:
    request_rate: float
    scheduled: int
    completed: int
    failed: int
    lost: int
    interrupted: bool
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: LatencyStats
    itl_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    slo: Slo
    good_requests: int
    spec_accept_length: float | None
    errors: dict[str, int]  # failure and loss reasons, most frequent first
    total_cached_tokens: int | None = None  # None: no completed request reported it
    cached_share: float | None = None  # of the prompt tokens of the requests that report it
    # Multi-turn runs: TTFT of the turns after each conversation's first (whose history a
    # prefix cache may hold), and of the first turns, apart.
    later_turns_ttft_ms: LatencyStats | None = None
    first_turns_ttft_ms: LatencyStats | None = None

    @property
    def sent(self) -> int:
        return self.completed + self.failed + self.lost

    @property
    def request_throughput(self) -> float:
        return self._per_second(self.completed)

    @property
    def input_token_throughput(self) -> float:
        return self._per_second(self.total_input_tokens)

    @property
    def output_token_throughput(self) -> float:
        return self._per_second(self.total_output_tokens)

    @property
    def goodput(self) -> float:
        return self._per_second(self.good_requests)

    def _per_second(self, count: int) -> float:
        return count / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "request_rate": rate_to_json(self.request_rate),
            "scheduled": self.scheduled,
            "sent": self.sent,
            "completed": self.completed,
            "failed": self.failed,
            "lost": self.lost,
            "interrupted": self.interrupted,
            "duration_s": round(self.duration_s, 4),
            "request_throughput": round(self.request_throughput, 4),
            "input_token_throughput": round(self.input_token_throughput, 2),
            "output_token_throughput": round(self.output_token_throughput, 2),
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "ttft_ms": self.ttft_ms.to_json(),
            "itl_ms": self.itl_ms.to_json(),
            "tpot_ms": self.tpot_ms.to_json(),
            "e2e_ms": self.e2e_ms.to_json(),
            "slo_ttft_ms": self.slo.ttft_ms,
            "slo_tpot_ms": self.slo.tpot_ms,
            "good_requests": self.good_requests,
            "goodput": round(self.goodput, 4),
            "spec_accept_length": self.spec_accept_length,
            "errors": self.errors,
            "total_cached_tokens": self.total_cached_tokens,
            "cached_share": self.cached_share,
            **{
                name: stats.to_json()
                for name, stats in (
                    ("later_turns_ttft_ms", self.later_turns_ttft_ms),
                    ("first_turns_ttft_ms", self.first_turns_ttft_ms),
                )
                if stats is not None
            },
        }


def summarize(run: RunResult, slo: Slo) -> RunSummary:
    completed = run.with_outcome(Outcome.COMPLETED)
    return RunSummary(
        request_rate=run.request_rate,
        scheduled=run.scheduled,
        completed=len(completed),
        failed=len(run.with_outcome(Outcome.FAILED)),
        lost=len(run.with_outcome(Outcome.LOST)),
        interrupted=run.interrupted,
        duration_s=run.duration_s,
        total_input_tokens=sum(result.prompt_tokens for result in completed),
        total_output_tokens=sum(result.output_tokens for result in completed),
        ttft_ms=LatencyStats.of(_present(result.ttft_s for result in completed)),
        itl_ms=LatencyStats.of([gap for result in completed for gap in result.itl_s]),
        tpot_ms=LatencyStats.of(_present(result.tpot_s for result in completed)),
        e2e_ms=LatencyStats.of(_present(result.e2e_s for result in completed)),
        slo=slo,
        good_requests=sum(slo.is_met_by(result) for result in completed),
        spec_accept_length=mean_accept_length(completed),
        errors=error_counts(run.results),
        **cached_prompt_tokens(completed),
        **ttft_by_turn(completed),
    )


def ttft_by_turn(results: Sequence[RequestResult]) -> dict[str, LatencyStats | None]:
    """A multi-turn run's TTFT over its first turns and over the turns after them; nothing
    for a run of single requests."""
    turns = [result for result in results if result.turn is not None]
    if not turns:
        return {}
    first = _present(result.ttft_s for result in turns if result.turn == 0)
    later = _present(result.ttft_s for result in turns if result.turn)
    return {
        "first_turns_ttft_ms": LatencyStats.of(first),
        "later_turns_ttft_ms": LatencyStats.of(later),
    }


def cached_prompt_tokens(results: Sequence[RequestResult]) -> dict[str, Any]:
    """total_cached_tokens and cached_share over the requests whose server reported them."""
    reporting = [result for result in results if result.cached_tokens is not None]
    if not reporting:
        return {"total_cached_tokens": None, "cached_share": None}
    cached = sum(result.cached_tokens or 0 for result in reporting)
    prompt = sum(result.prompt_tokens for result in reporting)
    share = round(cached / prompt, 4) if prompt > 0 else None
    return {"total_cached_tokens": cached, "cached_share": share}


def mean_accept_length(results: Sequence[RequestResult]) -> float | None:
    """Tokens per verify step over all the requests that report it: each request's accept
    length weighted by its verify steps (by 1 when the server gives no step count)."""
    weighted = [
        (result.spec_accept_length, result.spec_verify_steps or 1)
        for result in results
        if result.spec_accept_length is not None
    ]
    if not weighted:
        return None
    steps = sum(weight for _, weight in weighted)
    return round(sum(length * weight for length, weight in weighted) / steps, 4)


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    reasons = Counter(
        (result.error or "")[:ERROR_TEXT_LIMIT]
        for result in results
        if result.outcome is not Outcome.COMPLETED
    )
    return dict(reasons.most_common())


def _present(values: Any) -> list[float]:
    return [value for value in values if value is not None]
