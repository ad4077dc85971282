"""Where a cluster's nodes go on Ray: what each role asks for (a GPU a tensor parallel rank, or a
share of one; a role's custom resource where the Ray cluster declares one), whether the cluster can
ever hold it, waiting for workers still joining, and the placement group of one bundle per node."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.deploy.config import ClusterConfig
from cluster.deploy.node_factory import node_resources
from engine.errors import PdclusterError

log = logging.getLogger(__name__)


class ClusterStartError(PdclusterError, RuntimeError):
    """The cluster could not start; the message says which node or step failed."""


def cluster_device(requested: str | None) -> str:
    """The device the nodes run on: the one asked for, else cuda when the Ray cluster has GPUs
    (the head that runs this may have none), else cpu."""
    if requested:
        return requested
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


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
    if config.aggregated:
        # A replica is both roles: it asks for no role's resource.
        return [RoleDemand("replica", config.replicas, node_resources(config, "replica", on_gpu))]
    demands = []
    for role, count, resource in (
        ("prefill", config.prefill_nodes, config.prefill_resource),
        ("decode", config.decode_nodes, config.decode_resource),
    ):
        base = node_resources(config, role, on_gpu)
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


def wait_for_capacity(config: ClusterConfig, on_gpu: bool) -> list[RoleDemand]:
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


def place_nodes(config: ClusterConfig, on_gpu: bool) -> PlacementGroup:
    """One bundle per node, in rank order: prefill nodes first, then decode nodes."""
    demands = wait_for_capacity(config, on_gpu)
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
