"""Start a cluster on Ray: one actor per prefill and decode node, each in a placement-group
bundle of its own (one GPU each on GPU, or a share of one; on hosts that carry the role's custom
resource where the Ray cluster declares one), paired, joined into the data-plane process group
and connected to the router. An aggregated cluster starts replicas instead (each an engine that
prefills its own prompts), with no pairing and no process group. `Cluster.shutdown` stops every
actor."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig
from cluster.ray_start import init_ray
from cluster.router import NodeState, Router
from cluster.tracing import clock_offset_ns
from decode_node import AggregatedNode, DecodeNode
from engine.errors import PdclusterError
from engine.loader import EngineArgs, ModelSpec, resolve
from metadata.control_auth import new_control_key
from metadata.node_common import AUTO_HOST, NodeOptions
from metadata.process_group import create_store_server

log = logging.getLogger(__name__)
# On CPU the nodes share the host's cores; each bundle asks for a sliver so any mix fits.
CPU_NODE_SHARE = 0.01


class ClusterStartError(PdclusterError, RuntimeError):
    """The cluster could not start; the message says which node or step failed."""


@dataclass
class Cluster:
    config: ClusterConfig
    spec: ModelSpec
    router: Router
    prefill_actors: list  # none on an aggregated cluster
    decode_actors: list  # the replicas on an aggregated cluster
    placement: object
    started_ray: bool
    store: object
    # The cluster's control-plane key, drawn at launch (metadata.control_auth).
    control_key: bytes = field(repr=False)

    @classmethod
    def launch(cls, config: ClusterConfig) -> Cluster:
        started_ray = not ray.is_initialized()
        if started_ray:
            init_ray(config.ray_address, loopback_only=config.loopback_only)
        placement = None
        prefill_actors: list = []
        decode_actors: list = []
        store = None
        router: Router | None = None
        control_key = new_control_key()
        try:
            device = cluster_device(config.engine.device)
            spec = resolve(_driver_engine_args(config.engine, device))
            on_gpu = device.startswith("cuda")
            # On a cluster of hosts every socket binds its own host's address: the router and the
            # store the driver's, each node its own (resolved inside the node).
            joined = config.ray_address is not None
            host = ray.util.get_node_ip_address() if joined else "127.0.0.1"
            placement = _place(config, on_gpu)
            prefill_actors, decode_actors = _start_nodes(
                config, placement, on_gpu, AUTO_HOST if joined else "127.0.0.1", control_key
            )
            decode_role = "replica" if config.aggregated else "decode"
            prefill_info = _get([a.describe.remote() for a in prefill_actors], "prefill", config)
            decode_info = _get([a.describe.remote() for a in decode_actors], decode_role, config)
            kv_tokens = min(
                _get([a.stats.remote() for a in decode_actors], decode_role, config),
                key=lambda s: s["kv_capacity"],
            )["kv_capacity"]
            prefill_states = [
                NodeState("prefill", i, _pinger(a), info["endpoint"], stats=_stats_reader(a))
                for i, (a, info) in enumerate(zip(prefill_actors, prefill_info))
            ]
            decode_states = [
                NodeState(decode_role, i, _pinger(a), info["endpoint"], stats=_stats_reader(a))
                for i, (a, info) in enumerate(zip(decode_actors, decode_info))
            ]
            if config.enable_tracing:
                for state, actor in zip(
                    prefill_states + decode_states, prefill_actors + decode_actors
                ):
                    state.clock_offset_ns = clock_offset_ns(_clock_reader(actor))
            router = Router(
                spec,
                prefill_states,
                decode_states,
                kv_cache_tokens=kv_tokens,
                control_key=control_key,
                prefill_policy=config.prefill_policy,
                decode_policy=config.decode_policy,
                host=host,
                tracing=config.enable_tracing,
                trace_dir=config.trace_dir,
            )
            if config.aggregated:
                _get([a.connect.remote(router.endpoint) for a in decode_actors], "replica", config)
            else:
                store = _pair_and_join(
                    config,
                    host,
                    router,
                    (prefill_actors, prefill_info),
                    (decode_actors, decode_info),
                )
            _get([a.start.remote() for a in prefill_actors + decode_actors], "node", config)
        except BaseException:
            if router is not None:
                router.close_sockets()
            for actor in prefill_actors + decode_actors:
                ray.kill(actor)
            if placement is not None:
                remove_placement_group(placement)
            if started_ray:
                ray.shutdown()
            raise
        log.info("cluster up: %s on %s", describe_nodes(config), device)
        return cls(
            config,
            spec,
            router,
            prefill_actors,
            decode_actors,
            placement,
            started_ray,
            store,
            control_key,
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
        self.router.close_sockets()
        for actor in self.prefill_actors + self.decode_actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below anyway
                pass
            ray.kill(actor)
        remove_placement_group(self.placement)
        if self.started_ray:
            ray.shutdown()


def _pair_and_join(
    config: ClusterConfig,
    host: str,
    router: Router,
    prefill: tuple[list, list[dict]],
    decode: tuple[list, list[dict]],
):
    """Pair every decode node with every prefill node and the router, then join all of them
    into the data-plane process group (each prefill node opens a channel to every decode node
    and vice versa). `prefill`, `decode`: the role's actors and their `describe()`. Returns the
    group's store, which must live as long as the cluster."""
    (prefill_actors, prefill_info), (decode_actors, decode_info) = prefill, decode
    prefill_endpoints = {i: info["endpoint"] for i, info in enumerate(prefill_info)}
    prefill_specs = {i: info["spec"] for i, info in enumerate(prefill_info)}
    prefill_ranks = {i: config.prefill_rank(i) for i in range(len(prefill_info))}
    decode_endpoints = {i: info["endpoint"] for i, info in enumerate(decode_info)}
    _get(
        [
            a.connect.remote(prefill_endpoints, prefill_specs, prefill_ranks, router.endpoint)
            for a in decode_actors
        ],
        "decode",
        config,
    )
    _get([a.connect.remote(decode_endpoints) for a in prefill_actors], "prefill", config)
    store, port = create_store_server(host)
    decode_ranks = [config.decode_rank(i) for i in range(config.decode_nodes)]
    joins = [
        a.join_group.remote(host, port, prefill_ranks[i], config.world_size, decode_ranks)
        for i, a in enumerate(prefill_actors)
    ] + [
        a.join_group.remote(host, port, rank, config.world_size, list(prefill_ranks.values()))
        for rank, a in zip(decode_ranks, decode_actors)
    ]
    _get(joins, "node", config)
    return store


def cluster_device(requested: str | None) -> str:
    """The device the nodes run on: the one asked for, else cuda when the Ray cluster has GPUs
    (the head that runs this may have none), else cpu."""
    if requested:
        return requested
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def _driver_engine_args(args: EngineArgs, device: str) -> EngineArgs:
    # The driver needs the tokenizer and the model's shape, not a KV pool: each node sizes its
    # own, and the head may have no GPU to measure (a placeholder skips the measurement).
    return replace(args, device=device, kv_cache_tokens=args.kv_cache_tokens or 1)


@dataclass(frozen=True)
class RoleDemand:
    """What the nodes of one role ask Ray for: `count` bundles of `bundle` each."""

    role: str
    count: int
    bundle: dict[str, float]


def describe_nodes(config: ClusterConfig) -> str:
    if config.aggregated:
        return f"{config.replicas} aggregated replica{'s' if config.replicas != 1 else ''}"
    return f"{config.prefill_nodes} prefill + {config.decode_nodes} decode nodes"


def role_demands(
    config: ClusterConfig, on_gpu: bool, cluster_resources: dict[str, float]
) -> list[RoleDemand]:
    share = config.gpus_per_node
    gpus = int(share) if float(share).is_integer() else share  # a whole GPU reads "1"
    base = {"GPU": gpus, "CPU": 1} if on_gpu else {"CPU": CPU_NODE_SHARE}
    if config.aggregated:
        # A replica is both roles: it asks for no role's resource.
        return [RoleDemand("replica", config.replicas, base)]
    demands = []
    for role, count, resource in (
        ("prefill", config.prefill_nodes, config.prefill_resource),
        ("decode", config.decode_nodes, config.decode_resource),
    ):
        declared = bool(resource) and cluster_resources.get(resource, 0) > 0
        demands.append(RoleDemand(role, count, {resource: 1, **base} if declared else base))
    return demands


def shortfall(demands: list[RoleDemand], cluster_resources: dict[str, float]) -> str | None:
    """Why the cluster can never hold `demands` (its totals fall short), or None if it might."""
    asked: Counter[str] = Counter()
    for demand in demands:
        for name, amount in demand.bundle.items():
            asked[name] += amount * demand.count
    short = {name for name, amount in asked.items() if cluster_resources.get(name, 0) < amount}
    if not short:
        return None
    asked_for = ", ".join(
        f"{d.count} {d.role} node{'s' if d.count != 1 else ''} with {d.bundle} each"
        for d in demands
        if short & d.bundle.keys()
    )
    has = ", ".join(f"{name}={cluster_resources.get(name, 0):g}" for name in sorted(short))
    return f"asked for {asked_for}; the cluster has {has} in all"


def _wait_for_capacity(config: ClusterConfig, on_gpu: bool) -> list[RoleDemand]:
    deadline = time.monotonic() + config.node_wait_s
    announced = False
    while True:
        resources = ray.cluster_resources()
        demands = role_demands(config, on_gpu, resources)
        missing = shortfall(demands, resources)
        if missing is None:
            return demands
        if time.monotonic() >= deadline:
            waited = f" after waiting {config.node_wait_s:g} s" if config.node_wait_s else ""
            raise ClusterStartError(
                f"the Ray cluster is too small{waited}: {missing}. Add nodes that carry these "
                "resources, ask for fewer nodes, or wait for workers still joining "
                "(--wait-for-nodes SECONDS)"
            )
        if not announced:
            log.info("waiting up to %g s for the Ray cluster: %s", config.node_wait_s, missing)
            announced = True
        time.sleep(1.0)


def _place(config: ClusterConfig, on_gpu: bool) -> PlacementGroup:
    """One bundle per node, in rank order: prefill nodes first, then decode nodes."""
    demands = _wait_for_capacity(config, on_gpu)
    bundles = [dict(d.bundle) for d in demands for _ in range(d.count)]
    # PACK fills as few hosts as it can (GPUs of one host share the fastest links) and spills
    # over to more hosts when the bundles do not fit on one; STRICT_PACK would never spill.
    placement = placement_group(bundles, "PACK")
    done, _ = ray.wait([placement.ready()], timeout=config.startup_timeout_s)
    if not done:
        remove_placement_group(placement)
        wanted = "; ".join(f"{d.count} x {d.bundle}" for d in demands)
        raise ClusterStartError(
            f"Ray could not place the nodes ({wanted}) within {config.startup_timeout_s:.0f} s: "
            f"{ray.available_resources()} available"
        )
    return placement


def _start_nodes(
    config: ClusterConfig,
    placement: PlacementGroup,
    on_gpu: bool,
    node_host: str,
    control_key: bytes,
) -> tuple[list, list]:
    """Create every node actor in its bundle, each given the cluster's `control_key`; returns
    (prefill actors, decode actors), the latter the replicas on an aggregated cluster."""
    # Each actor sees only its own GPU, as cuda:0.
    engine_args = replace(config.engine, device="cuda:0" if on_gpu else "cpu")
    shares_gpu = on_gpu and config.shares_gpus
    if shares_gpu and engine_args.gpu_memory_utilization is None:
        engine_args = replace(engine_args, gpu_memory_utilization=config.gpus_per_node)
    threads = None if on_gpu else config.cpu_threads_per_node

    def create(actor_cls, role: str, index: int, rank: int):
        options = NodeOptions(
            role,
            index,
            bind_host=node_host,
            cpu_threads=threads,
            transfer_timeout_s=config.transfer_timeout_s,
            enable_tracing=config.enable_tracing,
            log_level=config.log_level,
            stats_log_interval_s=config.stats_log_interval_s,
            transfer_through_host=shares_gpu,
            control_key=control_key,
        )
        return actor_cls.options(
            num_gpus=config.gpus_per_node if on_gpu else 0,
            num_cpus=1 if on_gpu else CPU_NODE_SHARE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=rank
            ),
        ).remote(engine_args, options)

    if config.aggregated:
        replica_cls = ray.remote(AggregatedNode)
        return [], [create(replica_cls, "replica", i, i) for i in range(config.replicas)]
    prefill_cls = ray.remote(_prefill_class())
    decode_cls = ray.remote(DecodeNode)
    prefill = [
        create(prefill_cls, "prefill", i, config.prefill_rank(i))
        for i in range(config.prefill_nodes)
    ]
    decode = [
        create(decode_cls, "decode", i, config.decode_rank(i)) for i in range(config.decode_nodes)
    ]
    return prefill, decode


def _prefill_class():
    from prefill_node import PrefillNode

    return PrefillNode


def _pinger(actor):
    async def ping():
        return await actor.ping.remote()

    return ping


def _clock_reader(actor):
    def read() -> int:
        return ray.get(actor.clock_ns.remote(), timeout=30)

    return read


def _stats_reader(actor):
    async def stats():
        return await actor.stats.remote()

    return stats


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
