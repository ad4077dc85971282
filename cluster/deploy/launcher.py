"""Start a cluster on Ray: one actor per prefill and decode node, each in a placement-group
bundle of its own (one GPU each on GPU, or a share of one; on hosts that carry the role's custom
resource where the Ray cluster declares one), paired (a data-plane channel per prefill/decode
pair: cluster.control.pairing) and connected to the router, and watched by a supervisor that
replaces a node that dies (cluster.control.supervisor). An aggregated cluster starts replicas
instead (each an engine that prefills its own prompts), with no pairing and no process group.
`Cluster.shutdown` stops every actor."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import remove_placement_group

from cluster.control.node_state import NodeState
from cluster.control.pairing import NodeSlot, PairEpochs, pair_cluster, pair_replacement
from cluster.control.router import Router
from cluster.control.supervisor import NodeRestartPolicy, Supervisor, kill_for_good
from cluster.control.tracing import clock_offset_ns
from cluster.deploy.config import ClusterConfig
from cluster.deploy.node_factory import NodeFactory
from cluster.deploy.placement import (
    ClusterStartError,
    cluster_device,
    describe_nodes,
    place_nodes,
)
from cluster.deploy.ray_start import forwarded_env, init_ray
from engine.loading.loader import EngineArgs, ModelSpec
from metadata.control_auth import new_control_key
from metadata.node_common import AUTO_HOST
from metadata.process_group import create_store_server
from spec.compose import resolve_model

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    config: ClusterConfig
    spec: ModelSpec
    router: Router
    prefill_slots: list[NodeSlot]  # none on an aggregated cluster
    decode_slots: list[NodeSlot]  # the replicas on an aggregated cluster
    placement: object
    started_ray: bool
    store: object
    supervisor: Supervisor | None
    # The cluster's control-plane key, drawn at launch (metadata.control_auth).
    control_key: bytes = field(repr=False)

    @property
    def prefill_actors(self) -> list:
        """The prefill nodes' current actors (a replaced node's replacement)."""
        return [slot.actor for slot in self.prefill_slots]

    @property
    def decode_actors(self) -> list:
        """The decode nodes' (or replicas') current actors."""
        return [slot.actor for slot in self.decode_slots]

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
            spec = resolve_model(driver_engine_args(config.engine, device))
            on_gpu = device.startswith("cuda")
            # On a cluster of hosts every socket binds its own host's address: the router and the
            # store the driver's, each node its own (resolved inside the node).
            joined = config.ray_address is not None
            host = ray.util.get_node_ip_address() if joined else "127.0.0.1"
            placement = place_nodes(config, on_gpu)
            factory = NodeFactory(
                config,
                placement,
                on_gpu,
                AUTO_HOST if joined else "127.0.0.1",
                control_key,
                forwarded_env(),
            )
            prefill_actors, decode_actors = _start_nodes(config, factory)
            decode_role = "replica" if config.aggregated else "decode"
            prefill_info = _get([a.describe.remote() for a in prefill_actors], "prefill", config)
            decode_info = _get([a.describe.remote() for a in decode_actors], decode_role, config)
            kv_tokens = min(
                _get([a.stats.remote() for a in decode_actors], decode_role, config),
                key=lambda s: s["kv_capacity"],
            )["kv_capacity"]
            prefill_slots = [
                NodeSlot("prefill", i, config.prefill_rank(i), a, info)
                for i, (a, info) in enumerate(zip(prefill_actors, prefill_info))
            ]
            decode_slots = [
                NodeSlot(decode_role, i, config.decode_rank(i), a, info)
                for i, (a, info) in enumerate(zip(decode_actors, decode_info))
            ]
            states = [_node_state(slot, config) for slot in prefill_slots + decode_slots]
            router = Router(
                spec,
                states[: len(prefill_slots)],
                states[len(prefill_slots) :],
                kv_cache_tokens=kv_tokens,
                control_key=control_key,
                prefill_policy=config.prefill_policy,
                decode_policy=config.decode_policy,
                cache_aware_load_threshold=config.cache_aware_load_threshold,
                host=host,
                tracing=config.enable_tracing,
                trace_dir=config.trace_dir,
            )

            def get(refs: list, role: str) -> list:
                return _get(refs, role, config)

            epochs = None
            if not config.aggregated:
                store, port = create_store_server(host)
                epochs = PairEpochs(host, port)
                pair_cluster(prefill_slots, decode_slots, epochs, get)
            get([a.start.remote() for a in prefill_actors + decode_actors], "node")
            cluster = cls(
                config,
                spec,
                router,
                prefill_slots,
                decode_slots,
                placement,
                started_ray,
                store,
                None,
                control_key,
            )
            cluster.supervisor = _supervise(cluster, states, factory, epochs)
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
        return cluster

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
        if self.supervisor is not None:
            self.supervisor.stop()
        self.router.close_sockets()
        for actor in self.prefill_actors + self.decode_actors:
            _stop_node(actor)
        remove_placement_group(self.placement)
        if self.started_ray:
            ray.shutdown()


def _stop_node(actor) -> None:
    """Shut a node down, then let its process exit on its own and wait until it has. A node
    process still alive when its driver exits gets Ray's SIGTERM, which can land in the middle
    of the interpreter's cleanup and print a traceback. A node that fails to shut down or to
    exit in time is killed, and waited for too."""
    try:
        ray.get(actor.shutdown.remote(), timeout=15)
        ray.get(actor.__ray_terminate__.remote(), timeout=15)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
        return  # it has exited: a terminated actor's caller sees its death
    except Exception:  # noqa: BLE001 - stuck, or its shutdown failed: killed below
        pass
    kill_for_good(actor)


def _node_state(slot: NodeSlot, config: ClusterConfig) -> NodeState:
    state = NodeState(
        slot.role,
        slot.index,
        _pinger(slot.actor),
        slot.info["endpoint"],
        stats=_stats_reader(slot.actor),
    )
    if config.enable_tracing:
        state.clock_offset_ns = clock_offset_ns(_clock_reader(slot.actor))
    return state


def _supervise(
    cluster: Cluster, states: list[NodeState], factory: NodeFactory, epochs: PairEpochs | None
) -> Supervisor:
    """Start the supervisor that replaces the cluster's nodes when they die."""
    config = cluster.config
    prefill, decode = cluster.prefill_slots, cluster.decode_slots
    slots = prefill + decode

    def get(refs: list, role: str) -> list:
        return _get(refs, role, config)

    def peers_of(slot: NodeSlot) -> list[NodeSlot]:
        if slot.role == "replica":
            return []
        return decode if slot.role == "prefill" else prefill

    def bury(slot: NodeSlot, reason: str) -> None:
        slot.up = False
        kill_for_good(slot.actor)
        live = [peer for peer in peers_of(slot) if peer.up]
        refs = [peer.actor.peer_lost.remote(slot.index, slot.rank, reason) for peer in live]
        for ref in refs:
            try:
                ray.get(ref, timeout=90)  # the peer may finish a long step first
            except Exception as err:  # noqa: BLE001 - that peer is handled when found dead
                log.warning("telling a peer that %s is gone failed: %s", slot.name, err)

    def heal(slot: NodeSlot) -> tuple:
        actor = factory.create(slot.role, slot.index)
        try:
            slot.info = get([actor.describe.remote()], slot.role)[0]
            slot.actor = actor
            if slot.role != "replica":
                every = peers_of(slot)
                live = [peer for peer in every if peer.up]
                pair_replacement(slot, live, every, epochs, get)
            get([actor.start.remote()], slot.role)
        except BaseException:
            kill_for_good(actor)
            raise
        slot.up = True
        state = states[slots.index(slot)]
        if config.enable_tracing:
            state.clock_offset_ns = clock_offset_ns(_clock_reader(actor))
        return slot.info["endpoint"], _pinger(actor), _stats_reader(actor)

    def slot_of_rank(rank: int) -> NodeSlot | None:
        return next((s for s in slots if s.role != "replica" and s.rank == rank), None)

    policy = NodeRestartPolicy(
        config.max_node_restarts, config.node_restart_backoff_s, config.node_restart_backoff_max_s
    )

    def answers(slot: NodeSlot) -> bool:
        try:
            ray.get(slot.actor.ping.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - dead, dying or hung: the router's probe decides
            return False
        return True

    supervisor = Supervisor(
        cluster.router, list(zip(slots, states)), heal, bury, policy, slot_of_rank, answers
    )
    supervisor.start()
    return supervisor


def driver_engine_args(args: EngineArgs, device: str) -> EngineArgs:
    # The driver needs the tokenizer and the model's shape, not a KV pool: each node sizes its
    # own, and the head may have no GPU to measure (a placeholder skips the measurement).
    return replace(args, device=device, kv_cache_tokens=args.kv_cache_tokens or 1)


def _start_nodes(config: ClusterConfig, factory: NodeFactory) -> tuple[list, list]:
    """Create every node actor in its bundle; returns (prefill actors, decode actors), the
    latter the replicas on an aggregated cluster."""
    if config.aggregated:
        return [], [factory.create("replica", i) for i in range(config.replicas)]
    prefill = [factory.create("prefill", i) for i in range(config.prefill_nodes)]
    decode = [factory.create("decode", i) for i in range(config.decode_nodes)]
    return prefill, decode


def _prefill_class():
    from prefill_node import PrefillNode

    return PrefillNode


def _pinger(actor):
    async def ping():
        return await actor.health.remote()

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
