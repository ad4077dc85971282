"""What a node counts for observability: its transfers (count, bytes, seconds, latency buckets),
reported in its `stats()` for the router's /metrics, and the line it logs every few seconds
while busy. Both are updated by the node's serving thread only, and cost a clock read or a few
additions per call."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.request import Request, SpecStats
from metadata.transfer import TransferHandle, TransferState

# Upper bounds (seconds) of the transfer latency histogram; the last bucket is +Inf.
TRANSFER_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DEFAULT_LOG_INTERVAL_S = 5.0


class TransferTotals:
    """Totals of one node's finished transfers in one direction ("send" or "receive"). A
    transfer's time is its handle's: a send's, from the serving thread starting it to its end
    (a send begun right after the forward also spans the first token's sampling and draft
    extend); a receive's, from its posting, at the announcement, before the prefill's forward,
    to its landing."""

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.count = 0
        self.failed = 0
        self.nbytes = 0
        self.seconds = 0.0
        # Prompt positions whose target KV crossed, and those left out because the decode node
        # held them already (decode_node.reuse).
        self.kv_tokens = 0
        self.reused_tokens = 0
        self._bucket_counts = [0] * (len(TRANSFER_LATENCY_BUCKETS) + 1)

    def record(self, handle: TransferHandle, kv_tokens: int = 0, reused_tokens: int = 0) -> None:
        """Count a terminal transfer: a success adds its bytes, time and prompt positions (those
        sent, `kv_tokens`, and those reused), a failure its count."""
        if handle.state == TransferState.FAILED:
            self.failed += 1
            return
        self.count += 1
        self.kv_tokens += kv_tokens
        self.reused_tokens += reused_tokens
        self.nbytes += handle.nbytes
        self.seconds += handle.elapsed_s
        self._bucket_counts[bisect.bisect_left(TRANSFER_LATENCY_BUCKETS, handle.elapsed_s)] += 1

    def as_dict(self) -> dict:
        """Plain values for `stats()`; `latency_buckets` holds cumulative [upper bound, count]
        pairs as Prometheus histograms do, +Inf last."""
        cumulative, buckets = 0, []
        for bound, count in zip((*TRANSFER_LATENCY_BUCKETS, float("inf")), self._bucket_counts):
            cumulative += count
            buckets.append([bound, cumulative])
        return {
            "direction": self.direction,
            "count": self.count,
            "failed": self.failed,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "kv_tokens": self.kv_tokens,
            "reused_tokens": self.reused_tokens,
            "latency_buckets": buckets,
        }


@dataclass(frozen=True)
class Activity:
    """A node's load at one moment. `tokens` is cumulative (prompt tokens on a prefill node,
    generated tokens on a decode node); the `spec_*` counters are cumulative too. `running` is
    None where the node has no running set (prefill)."""

    running: int | None
    queued: int
    transfers_in_flight: int
    kv_used: int
    kv_capacity: int
    tokens: int
    spec_verify_steps: int = 0
    spec_emitted_tokens: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queued or self.transfers_in_flight)


def format_activity(now: Activity, before: Activity, elapsed_s: float) -> str:
    """One log line over the interval from `before` to `now`: the rates and the accept length
    are the interval's, the rest is `now`."""
    parts = [] if now.running is None else [f"running={now.running}"]
    parts.append(f"queued={now.queued}")
    rate = (now.tokens - before.tokens) / elapsed_s if elapsed_s > 0 else 0.0
    parts.append(f"tokens/s={rate:.1f}")
    steps = now.spec_verify_steps - before.spec_verify_steps
    if steps > 0:
        emitted = now.spec_emitted_tokens - before.spec_emitted_tokens
        parts.append(f"accept_length={emitted / steps:.2f}")
    usage = now.kv_used / now.kv_capacity if now.kv_capacity else 0.0
    parts.append(f"kv={usage:.1%}")
    parts.append(f"transfers_in_flight={now.transfers_in_flight}")
    return " ".join(parts)


class ActivityLog:
    """Logs `format_activity` every `interval_s` while the node is busy (interval_s <= 0: never).
    `tick` is called once per serving-loop iteration; it reads the clock and builds the
    snapshot only when a line is due."""

    def __init__(
        self,
        interval_s: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._log = logger
        self._clock = clock
        self._last_at = clock()
        # The counters start at zero with the node, so the first line covers its first interval.
        self._last = Activity(None, 0, 0, 0, 0, 0)

    def tick(self, snapshot: Callable[[], Activity]) -> str | None:
        """The line logged now, if any."""
        if self.interval_s <= 0:
            return None
        now = self._clock()
        if now - self._last_at < self.interval_s:
            return None
        activity = snapshot()
        before, elapsed = self._last, now - self._last_at
        self._last_at, self._last = now, activity
        if not activity.busy:
            return None
        line = format_activity(activity, before, elapsed)
        self._log.info(line)
        return line


def speculation_usage(stats: SpecStats | None) -> dict:
    """A finished request's speculation figures under their OpenAI `usage` names; empty when it
    never verified a draft."""
    if stats is None or not stats.verify_steps:
        return {}
    return {
        "completion_tokens_details": {
            "accepted_prediction_tokens": stats.accepted_tokens,
            "rejected_prediction_tokens": stats.rejected_tokens,
        },
        "spec_verify_steps": stats.verify_steps,
        "spec_accept_length": stats.accept_length,
    }


class SpeculationTotals:
    """A generating node's speculation counters: the finished requests' totals (added once,
    when a request's usage is reported), for its stats() and its periodic log line."""

    def __init__(self) -> None:
        self.finished = SpecStats()

    def usage(self, req: Request) -> dict:
        """`req`'s speculation figures for `usage`, also added to the totals."""
        usage = speculation_usage(req.spec_stats)
        if usage:
            self.finished.add(req.spec_stats)
        return usage

    def stats(self) -> dict:
        totals = self.finished
        return {
            "spec_verify_steps": totals.verify_steps,
            "spec_accept_length": totals.accept_length if totals.verify_steps else None,
            "spec_accepted_per_position": list(totals.accepted_per_position),
        }

    def with_running(self, running: list[Request]) -> tuple[int, int]:
        """(verify steps, emitted tokens) of the finished requests and `running` so far."""
        live = [r.spec_stats for r in running if r.spec_stats is not None]
        return (
            self.finished.verify_steps + sum(s.verify_steps for s in live),
            self.finished.emitted_tokens + sum(s.emitted_tokens for s in live),
        )
