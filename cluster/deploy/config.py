"""The cluster's configuration, built once from the CLI (or by tests) and never changed after."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from cluster.control.cache_aware import DEFAULT_LOAD_THRESHOLD
from cluster.control.policies import DECODE_POLICIES, POLICIES
from engine.loading.loader import EngineArgs

# Room for a full long context as text or token ids, and for some prompt_embeds vectors
# (a 4096-wide vector is about 80 KB of JSON); a body beyond it is refused with a 413.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineArgs = field(default_factory=EngineArgs)
    prefill_nodes: int = 1
    decode_nodes: int = 1
    # Aggregated: `replicas` nodes that each prefill and decode their own requests (no prefill
    # nodes, no KV transfer), behind the same router; prefill_nodes and decode_nodes are unused.
    aggregated: bool = False
    replicas: int = 1
    # Tensor parallel ranks of the prefill and of the decode nodes, where they differ from
    # engine.tensor_parallel_size (--tp, every node's); nodes of any sizes pair, each decode
    # rank taking its own KV heads from a prefill rank that holds them (metadata.rank_kv).
    prefill_tp: int | None = None
    decode_tp: int | None = None
    # The share of a GPU each node takes: 1, or a fraction so that nodes share a GPU (0.5: a
    # prefill and a decode node on one GPU), each sizing its KV pool from its share and
    # transferring through host memory (NCCL will not pair a GPU with itself). Unused on CPU.
    gpus_per_node: float = 1.0
    prefill_policy: str = "round_robin"
    decode_policy: str = "least_load"
    # cache_aware (cluster.control.cache_aware) sends a prompt to the prefill node holding its
    # longest cached prefix unless that node holds this many more requests than the least-loaded
    # one.
    cache_aware_load_threshold: int = DEFAULT_LOAD_THRESHOLD
    # Decode nodes keep finished requests' KV (a prefix cache, with the engine's) and take only
    # the KV of a prompt's positions past what they hold (decode_node.reuse); the decode policy
    # cache_aware sends a conversation's next turn back to the node that holds it.
    decode_reuse: bool = True
    ray_address: str | None = None
    # A local cluster (no ray_address) whose every socket, Ray's included, listens on loopback
    # only: for an HTTP API served on loopback (cluster.deploy.ray_start). Hosts of a joined cluster
    # must reach one another, so it cannot be asked with ray_address.
    loopback_only: bool = False
    # Custom Ray resources that mark the hosts for each role. Where the Ray cluster declares one,
    # each node of that role asks for one unit of it; where it does not, a node goes anywhere
    # with a free GPU. An empty name never asks.
    prefill_resource: str = "prefill"
    decode_resource: str = "decode"
    # How long to wait for the Ray cluster to hold the resources asked for (workers still
    # joining) before failing; 0 fails at once.
    node_wait_s: float = 0.0
    # Torch threads per node on CPU: several nodes share the host's cores.
    cpu_threads_per_node: int = 1
    # How long one KV transfer may take once posted; past it the transfer fails, the slots it
    # may still touch are held until its prefill node is replaced, and /health says degraded.
    transfer_timeout_s: float = 120.0
    startup_timeout_s: float = 600.0
    # Self-healing (cluster.control.supervisor): a node that dies is replaced on its resources after
    # node_restart_backoff_s, doubling for each death in a row (a replacement that dies within
    # NodeRestartPolicy.stable_after_s of starting) up to node_restart_backoff_max_s; after
    # max_node_restarts such restarts in a row it is reported failed and left down. 0: never
    # replace a node.
    max_node_restarts: int = 5
    node_restart_backoff_s: float = 1.0
    node_restart_backoff_max_s: float = 60.0
    # How often each node audits its KV pools against its live requests; <= 0: never.
    kv_audit_interval_s: float = 10.0
    # Per-request traces (cluster/control/tracing.py): kept for GET /v1/traces/{id}, summarized in
    # usage, and written as DIR/<request id>.json when trace_dir is set.
    enable_tracing: bool = False
    trace_dir: str | None = None
    # The nodes' logging level, and how often a busy node logs its load (<= 0: never).
    log_level: str = "info"
    stats_log_interval_s: float = 5.0
    # A request's tokens are streamed once this many are new (its first and last at once):
    # fewer, larger chunks for clients, and less work per token for the front ends.
    stream_interval: int = 1
    # Each generating node detokenizes and frames its streams in a worker process beside it
    # (decode_node.stream_worker), off the thread that drives its engine; None: on a GPU, where
    # that thread's time bounds the step and the host has cores to spare, not on a CPU, where
    # the worker would take the engine's cores.
    stream_worker: bool | None = None

    def tensor_parallel_size(self, role: str) -> int:
        """The ranks of a node of `role` (prefill, decode or replica)."""
        size = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return self.engine.tensor_parallel_size if size is None else size

    def __post_init__(self) -> None:
        if self.aggregated and self.replicas < 1:
            raise ValueError(
                f"an aggregated cluster needs at least one replica, got {self.replicas}"
            )
        if not self.aggregated and (self.prefill_nodes < 1 or self.decode_nodes < 1):
            raise ValueError("a cluster needs at least one prefill node and one decode node")
        for flag, size in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            if size is not None and self.aggregated:
                raise ValueError(
                    f"{flag} sets a disaggregated node's ranks: use --tp with --aggregated"
                )
            if size is not None and size < 1:
                raise ValueError(f"{flag} must be at least 1, got {size}")
        if self.prefill_policy not in POLICIES:
            raise ValueError(
                f"unknown prefill policy {self.prefill_policy!r}; supported: "
                f"{', '.join(sorted(POLICIES))}"
            )
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"unknown decode policy {self.decode_policy!r}; supported: "
                f"{', '.join(sorted(DECODE_POLICIES))}"
            )
        if self.cache_aware_load_threshold < 0:
            raise ValueError(
                f"cache_aware_load_threshold must be >= 0, got {self.cache_aware_load_threshold}"
            )
        if not 0 < self.gpus_per_node <= 1:
            raise ValueError(
                f"gpus_per_node must be in (0, 1] (a node uses one GPU at most), got "
                f"{self.gpus_per_node}"
            )
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"unknown log level {self.log_level!r}")
        if self.loopback_only and self.ray_address is not None:
            raise ValueError("a cluster that joins a Ray cluster cannot listen on loopback only")
        if self.node_wait_s < 0:
            raise ValueError(f"node_wait_s must be >= 0, got {self.node_wait_s}")
        if self.max_node_restarts < 0:
            raise ValueError(f"max_node_restarts must be >= 0, got {self.max_node_restarts}")
        if not 0 <= self.node_restart_backoff_s <= self.node_restart_backoff_max_s:
            raise ValueError(
                "node restart backoff must satisfy 0 <= backoff <= max backoff, got "
                f"{self.node_restart_backoff_s} and {self.node_restart_backoff_max_s}"
            )
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be positive, got {self.transfer_timeout_s}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.trace_dir is not None and not self.enable_tracing:
            raise ValueError("a trace directory needs tracing on (--enable-tracing)")
        if self.prefill_resource and self.prefill_resource == self.decode_resource:
            raise ValueError(
                f"prefill and decode nodes need different Ray resources, both are "
                f"{self.prefill_resource!r}"
            )

    @property
    def shares_gpus(self) -> bool:
        return self.gpus_per_node < 1

    @property
    def world_size(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    def prefill_rank(self, index: int) -> int:
        return index

    def decode_rank(self, index: int) -> int:
        return self.prefill_nodes + index


@dataclass(frozen=True)
class ServeConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # /metrics is open to scrapers by default, like /health; this puts it behind the API key.
    metrics_require_api_key: bool = False
    # After SIGTERM (or a first Ctrl-C), how long the requests in flight get to finish while new
    # ones are refused (cluster.frontend.admission); those left then end with an error naming the
    # drain.
    drain_timeout_s: float = 30.0
    # Generation requests in flight (admitted and not finished, waiting or generating) beyond
    # which new ones get a 429; None: no limit.
    max_queued_requests: int | None = None
    # A request with no first token this long after its arrival ends with an error; None: never.
    queue_timeout_s: float | None = None
    # HTTP front-end processes on the port (cluster.frontend.api_servers); 1: this process serves
    # it; None: `default_api_servers` for the cluster's device.
    api_servers: int | None = None

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be positive, got {self.max_queued_requests}"
            )
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be positive, got {self.queue_timeout_s}")
        if self.api_servers is not None and self.api_servers < 1:
            raise ValueError(f"api_servers must be at least 1, got {self.api_servers}")
        if self.metrics_require_api_key and self.api_key is None:
            raise ValueError("requiring the API key on /metrics needs an API key")


def default_api_servers(device: str, cpu_count: int | None = None) -> int:
    """One API process on a CPU, whose engine makes a few hundred tokens a second; on a GPU,
    whose engine makes tens of thousands (more than one process streams), one per 4 host
    cores up to 4 (the nodes need cores of their own)."""
    if not device.startswith("cuda"):
        return 1
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))
