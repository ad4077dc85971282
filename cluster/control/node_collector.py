"""Per-node Prometheus metrics for a backend's /metrics: each node's load, KV usage, prefix
cache, transfers, speculation and control-plane messages dropped by its inbox, copied from its
`stats()` (a Ray call for cluster nodes) when scraped, at most once per STATS_MAX_AGE_S, so
scrapes never hammer nodes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

STATS_MAX_AGE_S = 1.0
STATS_TIMEOUT_S = 5.0


class StatsSource(Protocol):
    """A node as the metrics see it (the router's NodeState is one): `stats` returns the
    node's stats() dict, or is None for a node that reports none."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def stats(self) -> Callable[[], Awaitable[dict]] | None: ...


class NodeCollector:
    """Per-node metrics from the latest stats of each node (a custom collector: the values
    are the nodes' own counters and gauges, copied at scrape time), and the router's count of
    dropped control messages beside the nodes'."""

    def __init__(self, nodes: Sequence[StatsSource], max_age_s: float = STATS_MAX_AGE_S) -> None:
        self._nodes = list(nodes)
        self._max_age_s = max_age_s
        self._stats: dict[str, dict] = {}
        self._fetched_at = float("-inf")

    async def refresh(self) -> None:
        """Fetch every live node's stats, unless the last fetch is younger than max_age_s."""
        now = time.monotonic()
        if now - self._fetched_at < self._max_age_s:
            return
        # Stamped first, so a scrape that arrives meanwhile serves the cache instead of asking too.
        self._fetched_at = now
        nodes = [n for n in self._nodes if n.alive and n.stats is not None]
        results = await asyncio.gather(
            *(asyncio.wait_for(n.stats(), STATS_TIMEOUT_S) for n in nodes), return_exceptions=True
        )
        stats = {}
        for node, result in zip(nodes, results):
            if isinstance(result, BaseException):
                log.warning("no stats from %s: %s", node.name, result)
            else:
                stats[node.name] = result
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        labels = ["node", "role"]
        up = GaugeMetricFamily(
            "pdcluster_node_up", "1 while the node answers probes.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "pdcluster_node_in_flight_requests",
            "Requests the router has routed to the node and not yet seen end.",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "pdcluster_node_restarts",
            "Times the node was replaced after it died (cluster.control.supervisor).",
            labels=labels,
        )
        degraded = GaugeMetricFamily(
            "pdcluster_node_degraded",
            "1 while the node serves with a fault (a transfer stuck past its timeout).",
            labels=labels,
        )
        for node in self._nodes:
            up.add_metric([node.name, node.role], 1.0 if node.alive else 0.0)
            in_flight.add_metric([node.name, node.role], node.in_flight)
            restarts.add_metric([node.name, node.role], getattr(node, "restarts", 0))
            is_degraded = node.alive and bool(getattr(node, "degraded", None))
            degraded.add_metric([node.name, node.role], 1.0 if is_degraded else 0.0)
        yield up
        yield in_flight
        yield restarts
        yield degraded
        families = _NodeFamilies()
        for node in self._nodes:
            stats = self._stats.get(node.name)
            if stats is not None:
                families.add(node.name, node.role, stats)
        yield from families.all()

    def latest(self, name: str) -> dict | None:
        """The stats of node `name` as last fetched."""
        return self._stats.get(name)


class _NodeFamilies:
    """The metric families built from nodes' stats dicts, one sample per node."""

    LABELS = ["node", "role"]

    def __init__(self) -> None:
        labels = self.LABELS
        self.running = GaugeMetricFamily(
            "pdcluster_node_running_requests", "Requests in the decode batch.", labels=labels
        )
        self.queued = GaugeMetricFamily(
            "pdcluster_node_queued_requests",
            "Requests waiting for KV (decode: preallocation, or retracted and waiting to run "
            "again; prefill: admission).",
            labels=labels,
        )
        self.kv_used = GaugeMetricFamily(
            "pdcluster_node_kv_used_tokens", "KV slots in use.", labels=labels
        )
        self.kv_capacity = GaugeMetricFamily(
            "pdcluster_node_kv_capacity_tokens", "KV slots in all.", labels=labels
        )
        self.kv_usage = GaugeMetricFamily(
            "pdcluster_node_kv_usage_ratio", "KV slots in use over KV slots in all.", labels=labels
        )
        self.transfers_in_flight = GaugeMetricFamily(
            "pdcluster_node_transfers_in_flight",
            "KV transfers announced and not yet ended.",
            labels=labels,
        )
        self.generated = CounterMetricFamily(
            "pdcluster_node_generation_tokens", "Tokens a decode node produced.", labels=labels
        )
        self.retractions = CounterMetricFamily(
            "pdcluster_node_retractions",
            "Running requests retracted because the KV pool ran short: their slots freed, they "
            "ran again later as a prefill of prompt + output so far.",
            labels=labels,
        )
        self.prompt = CounterMetricFamily(
            "pdcluster_node_prompt_tokens", "Prompt tokens a prefill node ran.", labels=labels
        )
        self.kv_audit_mismatches = CounterMetricFamily(
            "pdcluster_node_kv_audit_mismatches",
            "Audits that found a pool whose used slots differ from what live requests hold.",
            labels=labels,
        )
        self.kv_unaccounted = GaugeMetricFamily(
            "pdcluster_node_kv_unaccounted_tokens",
            "At the last audit: used slots no live request holds (negative: held, not used).",
            labels=labels,
        )
        self.kv_quarantined = GaugeMetricFamily(
            "pdcluster_node_kv_quarantined_tokens",
            "KV slots held for transfers stuck past their timeout, until the peer is replaced.",
            labels=labels,
        )
        self.transfers_stuck = GaugeMetricFamily(
            "pdcluster_node_transfers_stuck",
            "Transfers stuck past their timeout whose slots are held.",
            labels=labels,
        )
        self.prefix_lookup = CounterMetricFamily(
            "pdcluster_node_prefix_cache_lookup_tokens",
            "Prompt tokens looked up in the node's prefix cache when admitted.",
            labels=labels,
        )
        self.prefix_hit = CounterMetricFamily(
            "pdcluster_node_prefix_cache_hit_tokens",
            "Prompt tokens whose KV the node's prefix cache held (not computed again).",
            labels=labels,
        )
        self.prefix_evicted = CounterMetricFamily(
            "pdcluster_node_prefix_cache_evicted_tokens",
            "Cached tokens evicted from the node's prefix cache to make room.",
            labels=labels,
        )
        self.prefix_cached = GaugeMetricFamily(
            "pdcluster_node_prefix_cache_tokens",
            "Tokens whose KV the node's prefix cache holds now.",
            labels=labels,
        )
        self.control_rejected = CounterMetricFamily(
            "pdcluster_control_messages_rejected",
            "Control-plane messages a node's socket dropped: unsigned, forged, signed with "
            "another key, replayed or malformed.",
            labels=labels,
        )
        transfer = [*labels, "direction"]
        self.transfers = CounterMetricFamily(
            "pdcluster_node_transfers", "KV transfers that succeeded.", labels=transfer
        )
        self.transfer_failures = CounterMetricFamily(
            "pdcluster_node_transfer_failures", "KV transfers that failed.", labels=transfer
        )
        self.transfer_bytes = CounterMetricFamily(
            "pdcluster_node_transfer_bytes",
            "Bytes of successful KV transfers (KV and metadata row).",
            labels=transfer,
        )
        self.transfer_kv_tokens = CounterMetricFamily(
            "pdcluster_node_transfer_kv_tokens",
            "Prompt positions whose KV successful transfers carried.",
            labels=transfer,
        )
        self.transfer_reused_tokens = CounterMetricFamily(
            "pdcluster_node_transfer_reused_tokens",
            "Prompt positions successful transfers left out because the decode node held their "
            "KV already (a conversation's earlier turns).",
            labels=transfer,
        )
        self.transfer_seconds = CounterMetricFamily(
            "pdcluster_node_transfer_seconds",
            "Time successful KV transfers took on the node's clock: a send from its start (right "
            "after the prefill forward when it goes early, then including the first token) to "
            "its end; a receive from its posting at the announcement (before the prefill "
            "forward) to its landing. Wire speed is higher than bytes over these seconds.",
            labels=transfer,
        )
        self.transfer_throughput = GaugeMetricFamily(
            "pdcluster_node_transfer_gigabytes_per_second",
            "Mean transfer throughput since the node started (bytes / seconds / 1e9).",
            labels=transfer,
        )
        self.transfer_latency = HistogramMetricFamily(
            "pdcluster_node_transfer_latency_seconds",
            "Latency of each successful KV transfer.",
            labels=transfer,
        )
        spec = [*labels, "position"]
        self.verify_steps = CounterMetricFamily(
            "pdcluster_node_spec_verify_steps", "Speculative verify steps.", labels=labels
        )
        self.accepted = CounterMetricFamily(
            "pdcluster_node_spec_accepted_tokens",
            "Draft tokens accepted at each draft position (1 = the first draft token).",
            labels=spec,
        )
        self.acceptance_rate = GaugeMetricFamily(
            "pdcluster_node_spec_acceptance_rate",
            "Draft tokens accepted at each position per verify step, since the node started.",
            labels=spec,
        )
        self.plans = CounterMetricFamily(
            "pdcluster_node_spec_plans",
            "Decode steps of a speculating node by their round plan: its kind (plain, chain, "
            "tree) and the plan's label (chain/device, plain/catch_up, ...).",
            labels=[*labels, "kind", "plan"],
        )
        self.loop_seconds = CounterMetricFamily(
            "pdcluster_node_loop_seconds",
            "Time the node's serving thread spent in each part of its loop: waiting (for a "
            "message, nothing to run), engine (forward steps and their streams' reports), "
            "streams (handing each step's tokens on), other (messages, transfers, reports).",
            labels=[*labels, "part"],
        )
        self.steps = CounterMetricFamily(
            "pdcluster_node_steps",
            "The engine's forward steps by kind: decode, prefill, mixed (prompts beside the "
            "running requests' decode), and drains (overlap scheduling waiting for the step in "
            "flight before the batch could change).",
            labels=[*labels, "kind"],
        )

    def add(self, name: str, role: str, stats: dict) -> None:
        labels = [name, role]
        for family, key in (
            (self.running, "running"),
            (self.queued, "queued"),
            (self.transfers_in_flight, "transfers_in_flight"),
            (self.kv_used, "kv_used"),
            (self.kv_capacity, "kv_capacity"),
            (self.generated, "tokens_out"),
            (self.retractions, "retractions"),
            (self.prompt, "prompt_tokens"),
            (self.control_rejected, "control_rejected"),
            (self.kv_audit_mismatches, "kv_audit_mismatches"),
            (self.kv_unaccounted, "kv_unaccounted"),
            (self.kv_quarantined, "kv_quarantined"),
            (self.transfers_stuck, "transfers_stuck"),
            (self.prefix_lookup, "prefix_cache_lookup_tokens"),
            (self.prefix_hit, "prefix_cache_hit_tokens"),
            (self.prefix_evicted, "prefix_cache_evicted_tokens"),
            (self.prefix_cached, "prefix_cache_tokens"),
        ):
            if stats.get(key) is not None:
                family.add_metric(labels, stats[key])
        if stats.get("kv_capacity"):
            self.kv_usage.add_metric(labels, stats.get("kv_used", 0) / stats["kv_capacity"])
        if "transfers" in stats:
            self._add_transfers(labels, stats["transfers"])
        if stats.get("spec_accepted_per_position"):
            self._add_speculation(labels, stats)
        for plan, steps in (stats.get("spec_plans") or {}).items():
            self.plans.add_metric([*labels, plan.partition("/")[0], plan], steps)
        for part, seconds in (stats.get("loop_seconds") or {}).items():
            self.loop_seconds.add_metric([*labels, part], seconds)
        for kind, count in (stats.get("steps") or {}).items():
            self.steps.add_metric([*labels, kind], count)

    def _add_transfers(self, labels: list[str], totals: dict) -> None:
        labels = [*labels, totals["direction"]]
        self.transfers.add_metric(labels, totals["count"])
        self.transfer_failures.add_metric(labels, totals["failed"])
        self.transfer_bytes.add_metric(labels, totals["bytes"])
        self.transfer_seconds.add_metric(labels, totals["seconds"])
        self.transfer_kv_tokens.add_metric(labels, totals.get("kv_tokens", 0))
        self.transfer_reused_tokens.add_metric(labels, totals.get("reused_tokens", 0))
        seconds = totals["seconds"]
        self.transfer_throughput.add_metric(
            labels, totals["bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        )
        buckets = [(floatToGoString(bound), count) for bound, count in totals["latency_buckets"]]
        self.transfer_latency.add_metric(labels, buckets, totals["seconds"])

    def _add_speculation(self, labels: list[str], stats: dict) -> None:
        steps = stats.get("spec_verify_steps", 0)
        self.verify_steps.add_metric(labels, steps)
        for position, accepted in enumerate(stats["spec_accepted_per_position"], start=1):
            spec_labels = [*labels, str(position)]
            self.accepted.add_metric(spec_labels, accepted)
            self.acceptance_rate.add_metric(spec_labels, accepted / steps if steps else 0.0)

    def all(self) -> list[Metric]:
        return [value for value in vars(self).values() if isinstance(value, Metric)]
