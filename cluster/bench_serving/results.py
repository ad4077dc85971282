"""What a benchmark measures: one request's outcome and timings, and one run at one rate.

Every request a run sends ends in exactly one outcome, so completed + failed + lost == sent:
- completed: the stream finished ([DONE] or a finish reason);
- failed: the server said no (a non-2xx answer, an error event in the stream) or could not be
  reached; the reason is kept;
- lost: it never ended: no end within the timeout, a connection dropped mid-stream without an
  error, or cancelled when the run was interrupted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    LOST = "lost"


@dataclass(frozen=True)
class RequestResult:
    """One sent request. Times are seconds; `sent_at` is on the time.perf_counter() clock.
    Timings are those observed until the request ended, whatever its outcome."""

    index: int  # the request's position in the dataset, the same at every rate
    outcome: Outcome
    sent_at: float
    prompt_tokens: int  # the server's count (usage) when it reports one, else the dataset's
    output_tokens: int  # usage.completion_tokens when reported, else content chunks received
    ttft_s: float | None = None  # until the first chunk carrying content
    itl_s: tuple[float, ...] = ()  # the gaps between consecutive content chunks
    e2e_s: float | None = None  # until the stream ended
    error: str | None = None
    spec_accept_length: float | None = None
    spec_verify_steps: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server reused; None: not reported
    output_text: str = ""  # the answer as streamed (a conversation's next turn carries it)
    turn: int | None = None  # a conversation's turn (0: its first); None outside multi-turn runs

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two output tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def lost(cls, index: int, sent_at: float, prompt_tokens: int, reason: str) -> RequestResult:
        return cls(index, Outcome.LOST, sent_at, prompt_tokens, 0, error=reason)

    def to_json(self, run_started_at: float) -> dict[str, Any]:
        return {
            "index": self.index,
            "outcome": str(self.outcome),
            "error": self.error,
            "sent_at_s": round(self.sent_at - run_started_at, 6),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": milliseconds(self.ttft_s),
            "tpot_ms": milliseconds(self.tpot_s),
            "e2e_ms": milliseconds(self.e2e_s),
            "itl_ms": [milliseconds(gap) for gap in self.itl_s],
            "spec_accept_length": self.spec_accept_length,
            "cached_tokens": self.cached_tokens,
            "turn": self.turn,
        }


@dataclass(frozen=True)
class RunResult:
    """Every request one run sent, at one request rate."""

    request_rate: float
    scheduled: int  # the requests the run meant to send
    started_at: float  # time.perf_counter() when the first arrival was due
    duration_s: float  # until the last request ended (or the interruption)
    results: list[RequestResult] = field(default_factory=list)
    interrupted: bool = False

    @property
    def sent(self) -> int:
        return len(self.results)

    def with_outcome(self, outcome: Outcome) -> list[RequestResult]:
        return [result for result in self.results if result.outcome is outcome]


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def rate_to_json(rate: float) -> float | str:
    """JSON has no infinity: an unlimited rate is written "inf" (float("inf") reads it back)."""
    return "inf" if math.isinf(rate) else rate
