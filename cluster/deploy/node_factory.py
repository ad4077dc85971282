"""Creating node actors: each in its own placement-group bundle, with the cluster's options.
The launcher starts every node with it, and the supervisor a replacement in the bundle of the
node it replaces (the bundle outlives its actor)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.deploy.config import ClusterConfig
from metadata.node_common import NodeOptions

# On CPU the nodes share the host's cores; each bundle asks for a sliver so any mix fits.
CPU_NODE_SHARE = 0.01


def node_resources(config: ClusterConfig, role: str, on_gpu: bool) -> dict[str, float]:
    """What one node of `role` asks Ray for, its tensor parallel ranks' included: a GPU (or
    the share `gpus_per_node`) and a core a rank on GPU, a sliver a rank on CPU. One bundle
    holds them, so the ranks land on one host together."""
    ranks = config.tensor_parallel_size(role)
    share = config.gpus_per_node * ranks
    gpus = int(share) if float(share).is_integer() else share  # a whole GPU reads "1"
    if on_gpu:
        return {"GPU": gpus, "CPU": ranks}
    return {"CPU": CPU_NODE_SHARE * ranks}


@dataclass
class NodeFactory:
    config: ClusterConfig
    placement: PlacementGroup
    on_gpu: bool
    node_host: str
    control_key: bytes
    # The environment each node starts with (PDCLUSTER_* and the rest `forwarded_env` picks),
    # taken when the cluster launches, so a replacement sees what its predecessor saw.
    env: dict[str, str]

    def bundle(self, role: str, index: int) -> int:
        """The node's bundle: its data-plane rank (prefill nodes first, then decode nodes)."""
        if role == "decode":
            return self.config.decode_rank(index)
        if role == "prefill":
            return self.config.prefill_rank(index)
        return index  # a replica

    def create(self, role: str, index: int):
        """A new actor for node `role`-`index`, in its bundle."""
        config, on_gpu = self.config, self.on_gpu
        # Each actor sees only its own GPU, as cuda:0.
        engine_args = replace(
            config.engine,
            device="cuda:0" if on_gpu else "cpu",
            tensor_parallel_size=config.tensor_parallel_size(role),
        )
        shares_gpu = on_gpu and config.shares_gpus
        if shares_gpu and engine_args.gpu_memory_utilization is None:
            engine_args = replace(engine_args, gpu_memory_utilization=config.gpus_per_node)
        options = NodeOptions(
            role,
            index,
            bind_host=self.node_host,
            cpu_threads=None if on_gpu else config.cpu_threads_per_node,
            transfer_timeout_s=config.transfer_timeout_s,
            enable_tracing=config.enable_tracing,
            log_level=config.log_level,
            stats_log_interval_s=config.stats_log_interval_s,
            transfer_through_host=shares_gpu,
            kv_audit_interval_s=config.kv_audit_interval_s,
            stream_interval=config.stream_interval,
            decode_reuse=config.decode_reuse,
            stream_worker=on_gpu if config.stream_worker is None else config.stream_worker,
            control_key=self.control_key,
        )
        resources = node_resources(config, role, on_gpu)
        return (
            ray.remote(_node_class(role))
            .options(
                num_gpus=resources.get("GPU", 0),
                num_cpus=resources["CPU"],
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=self.bundle(role, index)
                ),
                runtime_env={"env_vars": self.env},
            )
            .remote(engine_args, options)
        )


def _node_class(role: str):
    # Looked up through the launcher at each call, so tests can swap the prefill class.
    from cluster.deploy import launcher

    if role == "prefill":
        return launcher._prefill_class()
    from decode_node import AggregatedNode, DecodeNode

    return AggregatedNode if role == "replica" else DecodeNode
