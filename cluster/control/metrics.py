"""Prometheus metrics of a serving backend, for GET /metrics: one scrape sees the whole cluster.

- Request latencies, observed where the router sees tokens arrive: time to first token, inter-token
  latency (the gap between two deltas divided by the delta's tokens, once per token), end to end;
  the accept length of each speculative request; requests by finish reason; failures by kind.
- Each node's load, KV usage, transfers and speculation, read from its `stats()` when scraped
  (cluster.control.node_collector).
- Control-plane messages dropped (unauthenticated, replayed or malformed: metadata.control_auth)
  by each node's inbox, and by the front ends' own.

Every `ClusterMetrics` owns its registry (never prometheus_client's global one), so two routers in
one process never share or clash over a metric. Several API processes (`--api-servers`) keep
their request metrics in prometheus_client's multiprocess files (`multiprocess_dir`), so that
any of them renders the totals of all; the node metrics come from the nodes themselves.
Transfer GB/s over a window is
`rate(pdcluster_node_transfer_bytes_total[1m]) / rate(pdcluster_node_transfer_seconds_total[1m])
/ 1e9`; `pdcluster_node_transfer_gigabytes_per_second` is the node's mean since it started.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from cluster.control.node_collector import NodeCollector, StatsSource

CONTENT_TYPE = CONTENT_TYPE_LATEST
FAILURE_KINDS = ("rejected", "overloaded", "node_down", "transfer", "aborted", "error")
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


def failure_kind(error: str) -> str:
    """The kind of a request's terminal error as a decode node words it."""
    return "transfer" if "transfer" in error.lower() else "error"


class ClusterMetrics:
    def __init__(
        self, nodes: Sequence[StatsSource], multiprocess_dir: str | None = None
    ) -> None:
        """`multiprocess_dir`: where the API processes of one cluster keep their metrics
        (prometheus_client's multiprocess mode, which the process's environment must have
        turned on before prometheus_client was imported: PROMETHEUS_MULTIPROC_DIR)."""
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        registry = self.registry
        self.ttft = Histogram(
            "pdcluster_time_to_first_token_seconds",
            "From the request reaching the router to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "pdcluster_inter_token_latency_seconds",
            "Time per output token after the first: each delta's gap over its tokens.",
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pdcluster_e2e_request_latency_seconds",
            "From the request reaching the router to its last token, for finished requests.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.accept_length = Histogram(
            "pdcluster_spec_accept_length",
            "Tokens committed per verify step, one observation per speculative request.",
            buckets=ACCEPT_LENGTH_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "pdcluster_requests",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.failures = Counter(
            "pdcluster_request_failures",
            "Requests that failed, by kind: rejected (invalid, 400, or too large, 413), "
            "overloaded (refused at admission: too many in flight, 429, or draining, 503), "
            "node_down, transfer, "
            "aborted (client gone, cancelled or past the queue timeout), error (anything else).",
            ["kind"],
            registry=registry,
        )
        for kind in FAILURE_KINDS:
            self.failures.labels(kind)  # every kind is visible at 0 from the start
        self.prompt_tokens = Counter(
            "pdcluster_prompt_tokens",
            "Prompt tokens of finished requests, a prompt's parallel samples counted once.",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "pdcluster_generation_tokens", "Tokens streamed to clients.", registry=registry
        )
        self.control_rejected = Counter(
            "pdcluster_frontend_control_messages_rejected",
            "Control-plane messages the front ends' own sockets dropped: unsigned, forged, "
            "signed with another key, replayed or malformed (the nodes': "
            "pdcluster_control_messages_rejected).",
            registry=registry,
        )
        self.nodes = NodeCollector(nodes)
        registry.register(self.nodes)

    def request(self) -> RequestTimer:
        """Start timing one request, now."""
        return self.samples(1)[0]

    def samples(self, count: int) -> list[RequestTimer]:
        """Start timing a prompt's `count` parallel samples, now: each is a request, and the
        prompt they share is counted once, when the first of them finishes."""
        prompt = _PromptTokens(self.prompt_tokens)
        return [RequestTimer(self, prompt=prompt) for _ in range(count)]

    def failure(self, kind: str) -> None:
        self.failures.labels(kind).inc()

    async def render(self) -> bytes:
        """The exposition text, with node stats at most STATS_MAX_AGE_S old."""
        await self.nodes.refresh()
        if self.multiprocess_dir is None:
            return _generate_latest(self.registry)
        # Every API process's request metrics (a process that died counts too), and the nodes'.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        registry.register(self.nodes)
        return _generate_latest(registry)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value` at once: as `count` calls of `observe`, in one update
    of the bucket and the sum. (prometheus_client has no weighted observe; this reads its
    histogram's buckets, and falls back to the calls where they are not there.)"""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    if buckets is None or bounds is None:
        for _ in range(count):
            histogram.observe(value)
        return
    histogram._sum.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)


class _PromptTokens:
    """A prompt's tokens, counted once however many of its samples finish."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._counted = False

    def count(self, tokens: int) -> None:
        if not self._counted:
            self._counted = True
            self._counter.inc(tokens)


class RequestTimer:
    """One request's latencies, observed into its ClusterMetrics as the tokens arrive."""

    def __init__(
        self,
        metrics: ClusterMetrics,
        clock: Callable[[], float] = time.perf_counter,
        prompt: _PromptTokens | None = None,
    ):
        self._metrics = metrics
        self._clock = clock
        self._prompt = prompt or _PromptTokens(metrics.prompt_tokens)
        self.started = self._last = clock()
        self.first_token_at: float | None = None

    def tokens(self, count: int) -> None:
        """`count` tokens arrived now (a delta; speculation may bring several at once)."""
        if count <= 0:
            return
        now = self._clock()
        metrics = self._metrics
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft.observe(now - self.started)
            count_after_first = count - 1
        else:
            count_after_first = count
        if count_after_first:
            per_token = (now - self._last) / count_after_first
            observe_many(metrics.inter_token, per_token, count_after_first)
        self._last = now
        metrics.generation_tokens.inc(count)

    def finished(self, finish_reason: str, usage: dict[str, Any]) -> None:
        metrics = self._metrics
        metrics.e2e.observe(self._clock() - self.started)
        metrics.requests.labels(finish_reason).inc()
        self._prompt.count(usage.get("prompt_tokens", 0))
        accept_length = usage.get("spec_accept_length")
        if accept_length is not None:
            metrics.accept_length.observe(accept_length)

    def failed(self, kind: str) -> None:
        self._metrics.failure(kind)
