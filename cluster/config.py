"""The cluster's configuration, built once from the CLI (or by tests) and never changed after."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.loader import EngineArgs


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineArgs = field(default_factory=EngineArgs)
    prefill_nodes: int = 1
    decode_nodes: int = 1
    prefill_policy: str = "round_robin"
    decode_policy: str = "least_load"
    ray_address: str | None = None
    # Torch threads per node on CPU: several nodes share the host's cores.
    cpu_threads_per_node: int = 1
    transfer_timeout_s: float = 120.0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise ValueError("a cluster needs at least one prefill node and one decode node")

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
