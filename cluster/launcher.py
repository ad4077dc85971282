"""Start a cluster on Ray: one actor per prefill and decode node, each in a placement-group
bundle of its own (one GPU each on GPU), paired, joined into the data-plane process group and
connected to the router. `Cluster.shutdown` stops every actor."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig
from cluster.router import NodeState, Router
from decode_node import DecodeNode
from engine.loader import ModelSpec, resolve
from metadata.node_common import NodeOptions
from metadata.process_group import create_store_server

log = logging.getLogger(__name__)
# On CPU the nodes share the host's cores; each bundle asks for a sliver so any mix fits.
CPU_NODE_SHARE = 0.01


class ClusterStartError(RuntimeError):
    """The cluster could not start; the message says which node or step failed."""


@dataclass
class Cluster:
    config: ClusterConfig
    spec: ModelSpec
    router: Router
    prefill_actors: list
    decode_actors: list
    placement: object
    started_ray: bool
    store: object

    @classmethod
    def launch(cls, config: ClusterConfig) -> Cluster:
        spec = resolve(config.engine)
        device = spec.engine_config.device
        on_gpu = device.startswith("cuda")
        started_ray = not ray.is_initialized()
        if started_ray:
            init_ray(config.ray_address)
        host = "127.0.0.1" if config.ray_address is None else ray.util.get_node_ip_address()
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": CPU_NODE_SHARE}
        placement = placement_group([dict(bundle) for _ in range(config.world_size)], "PACK")
        ready = placement.ready()
        done, _ = ray.wait([ready], timeout=config.startup_timeout_s)
        if not done:
            remove_placement_group(placement)
            raise ClusterStartError(
                f"Ray could not place {config.world_size} nodes needing {bundle} each "
                f"within {config.startup_timeout_s:.0f} s: {ray.available_resources()} available"
            )
        engine_args = config.engine
        if on_gpu:
            # Each actor sees only its own GPU, as cuda:0.
            engine_args = type(engine_args)(**{**engine_args.__dict__, "device": "cuda:0"})
        else:
            engine_args = type(engine_args)(**{**engine_args.__dict__, "device": "cpu"})

        def options(bundle_index: int) -> dict:
            return {
                "num_gpus": 1 if on_gpu else 0,
                "num_cpus": 1 if on_gpu else CPU_NODE_SHARE,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=bundle_index
                ),
            }

        threads = None if on_gpu else config.cpu_threads_per_node
        prefill_cls = ray.remote(_prefill_class())
        decode_cls = ray.remote(DecodeNode)
        prefill_actors = [
            prefill_cls.options(**options(config.prefill_rank(i))).remote(
                engine_args,
                NodeOptions(
                    "prefill", i, host, threads, transfer_timeout_s=config.transfer_timeout_s
                ),
            )
            for i in range(config.prefill_nodes)
        ]
        decode_actors = [
            decode_cls.options(**options(config.decode_rank(i))).remote(
                engine_args,
                NodeOptions(
                    "decode", i, host, threads, transfer_timeout_s=config.transfer_timeout_s
                ),
            )
            for i in range(config.decode_nodes)
        ]
        store = None
        try:
            prefill_info = _get([a.describe.remote() for a in prefill_actors], "prefill", config)
            decode_info = _get([a.describe.remote() for a in decode_actors], "decode", config)
            kv_tokens = min(
                _get([a.stats.remote() for a in decode_actors], "decode", config),
                key=lambda s: s["kv_capacity"],
            )["kv_capacity"]
            prefill_states = [
                NodeState("prefill", i, _pinger(a), info["endpoint"])
                for i, (a, info) in enumerate(zip(prefill_actors, prefill_info))
            ]
            decode_states = [
                NodeState("decode", i, _pinger(a), info["endpoint"])
                for i, (a, info) in enumerate(zip(decode_actors, decode_info))
            ]
            router = Router(
                spec,
                prefill_states,
                decode_states,
                kv_cache_tokens=kv_tokens,
                prefill_policy=config.prefill_policy,
                decode_policy=config.decode_policy,
                host=host,
            )
            prefill_endpoints = {i: info["endpoint"] for i, info in enumerate(prefill_info)}
            prefill_specs = {i: info["spec"] for i, info in enumerate(prefill_info)}
            decode_endpoints = {i: info["endpoint"] for i, info in enumerate(decode_info)}
            _get(
                [
                    a.connect.remote(prefill_endpoints, prefill_specs, router.endpoint)
                    for a in decode_actors
                ],
                "decode",
                config,
            )
            _get([a.connect.remote(decode_endpoints) for a in prefill_actors], "prefill", config)
            store, port = create_store_server(host)
            joins = [
                a.join_group.remote(host, port, rank, config.world_size)
                for rank, a in [(config.prefill_rank(i), a) for i, a in enumerate(prefill_actors)]
                + [(config.decode_rank(i), a) for i, a in enumerate(decode_actors)]
            ]
            _get(joins, "node", config)
            _get([a.start.remote() for a in prefill_actors + decode_actors], "node", config)
        except Exception:
            for actor in prefill_actors + decode_actors:
                ray.kill(actor)
            remove_placement_group(placement)
            if started_ray:
                ray.shutdown()
            raise
        log.info(
            "cluster up: %d prefill, %d decode nodes on %s",
            config.prefill_nodes,
            config.decode_nodes,
            device,
        )
        return cls(
            config, spec, router, prefill_actors, decode_actors, placement, started_ray, store
        )

    def node_stats(self) -> list[dict]:
        refs = [a.stats.remote() for a in self.prefill_actors + self.decode_actors]
        stats = []
        for ref in refs:
            try:
                stats.append(ray.get(ref, timeout=30))
            except Exception as err:  # noqa: BLE001 - a dead node reports its error
                stats.append({"error": str(err).splitlines()[0]})
        return stats

    def kv_pools_empty(self) -> bool:
        refs = [a.kv_is_empty.remote() for a in self.prefill_actors + self.decode_actors]
        return all(ray.get(refs, timeout=30))

    def shutdown(self) -> None:
        for actor in self.prefill_actors + self.decode_actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below anyway
                pass
            ray.kill(actor)
        remove_placement_group(self.placement)
        if self.started_ray:
            ray.shutdown()


def init_ray(address: str | None) -> None:
    """Start a local Ray instance (address None) or join one; nodes inherit the settings they
    need from this process's environment."""
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": _forwarded_env()},
    )


def _prefill_class():
    from prefill_node import PrefillNode

    return PrefillNode


def _pinger(actor):
    async def ping():
        return await actor.ping.remote()

    return ping


def _get(refs: list, role: str, config: ClusterConfig) -> list:
    try:
        return ray.get(refs, timeout=config.startup_timeout_s)
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if getattr(err, "cause", None) is not None else err
        raise ClusterStartError(f"a {role} node failed to start: {cause}") from err
    except ray.exceptions.GetTimeoutError as err:
        raise ClusterStartError(
            f"{role} nodes did not answer within {config.startup_timeout_s:.0f} s"
        ) from err


def _forwarded_env() -> dict[str, str]:
    """Environment the nodes need from the driver (model cache location, NCCL settings)."""
    keys = [k for k in os.environ if k.startswith(("PDCLUSTER_", "NCCL_", "TORCH_", "NVSHMEM_"))]
    keys += [k for k in ("XDG_CACHE_HOME", "HF_HOME") if k in os.environ]
    return {k: os.environ[k] for k in keys}
