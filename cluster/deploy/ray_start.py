"""Starting a local Ray instance for a cluster, or joining one.

A cluster that serves its HTTP API on loopback only starts a Ray instance that listens on
loopback only: Ray's GCS, raylet, object manager, workers and agents bind the address of the
Ray node they belong to, and their gRPC servers bind 127.0.0.1 instead of every interface when
that address is 127.0.0.1. Ray 2.60 does not let `ray.init(_node_ip_address="127.0.0.1")` (or
`ray start --node-ip-address 127.0.0.1`) say so: `resolve_ip_for_localhost` turns a loopback
address into the host's routable one unless `ray_constants.ENABLE_RAY_CLUSTER` is off, which it
is only on Windows and macOS or with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 set before Ray is
imported. `init_ray` switches it off around `ray.init` alone: once a node is running, Ray reads
the node's address from the node, and the processes Ray starts are given it on their command
lines. A joined cluster's hosts must reach one another, so joining never binds loopback; Ray's
token authentication guards those sockets instead (docs/deploy.md, "Security").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, MutableMapping

import ray
from ray._private import ray_constants

from engine.env import FAULT_ENV_VARS
from metadata.loopback import is_loopback

log = logging.getLogger(__name__)

LOOPBACK_NODE_ADDRESS = "127.0.0.1"

# Ray's own observability, which pdcluster reads nowhere (no dashboard, no state API, no Ray
# metrics: the cluster's metrics are its own, cluster.control.metrics) and which costs the serving
# process CPU every second whatever the load: the buffer of task events its core worker sends
# to the GCS each second (disabled by an interval of 0), and the recording and export of Ray's
# internal metrics. Neither takes part in detecting failures (actor deaths come from the GCS,
# node health from the router's probes). Set before `ray.init`, they reach the processes a
# local instance starts; a variable already set is kept.
RAY_OBSERVABILITY_OFF = {
    "RAY_task_events_report_interval_ms": "0",
    "RAY_enable_metrics_collection": "0",
}


def init_ray(address: str | None, *, loopback_only: bool = False) -> None:
    """Start a local Ray instance (address None) or join one; nodes inherit the settings they
    need from this process's environment. With no address Ray would otherwise attach to any
    cluster already running on this host, so "local" asks for a fresh one explicitly.
    `loopback_only` (local instances only) keeps every socket of the instance on loopback."""
    if loopback_only and address is not None:
        raise ValueError("a joined Ray cluster cannot listen on loopback only")
    without_ray_observability(os.environ)
    options: dict = {
        "address": address or "local",
        "include_dashboard": False,
        "log_to_driver": True,
        "runtime_env": {"env_vars": forwarded_env()},
    }
    if not loopback_only:
        ray.init(**options)
        return
    with _loopback_node_addresses_allowed():
        ray.init(**options, _node_ip_address=LOOPBACK_NODE_ADDRESS)
    node_address = ray.util.get_node_ip_address()
    if not is_loopback(node_address):
        log.warning(
            "this Ray version gave the local node the address %s in place of %s: its "
            "sockets listen beyond loopback",
            node_address,
            LOOPBACK_NODE_ADDRESS,
        )


def without_ray_observability(environ: MutableMapping[str, str]) -> None:
    """Switch off what RAY_OBSERVABILITY_OFF names in `environ`, unless set there already."""
    for key, value in RAY_OBSERVABILITY_OFF.items():
        environ.setdefault(key, value)


@contextlib.contextmanager
def _loopback_node_addresses_allowed() -> Iterator[None]:
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is None:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = before


def forwarded_env() -> dict[str, str]:
    """Environment the nodes need from the driver (model cache location, NCCL and gloo
    settings). Every fault variable is set, empty when the driver has none: Ray merges an
    actor's variables into those its job started with, so a node would otherwise inherit the
    faults of whatever environment the Ray instance was started in."""
    prefixes = ("PDCLUSTER_", "NCCL_", "TORCH_", "NVSHMEM_", "GLOO_")
    keys = [k for k in os.environ if k.startswith(prefixes)]
    keys += [k for k in ("XDG_CACHE_HOME", "HF_HOME") if k in os.environ]
    return {**dict.fromkeys(FAULT_ENV_VARS, ""), **{k: os.environ[k] for k in keys}}
