"""Start clusters for tests: one Ray instance per test session, clusters on tiny models."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from cluster.deploy.config import ClusterConfig
from cluster.deploy.launcher import Cluster, init_ray
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine.loading.loader import EngineArgs


def ensure_ray() -> None:
    if not ray.is_initialized():
        init_ray(None)


def launch(
    model: str,
    prefill: int,
    decode: int,
    prefill_policy: str = "round_robin",
    decode_policy: str = "least_load",
    decode_reuse: bool = True,
    **engine: object,
) -> Cluster:
    ensure_ray()
    engine_args = EngineArgs(model=model, device="cpu", **engine)
    return Cluster.launch(
        ClusterConfig(
            engine=engine_args,
            prefill_nodes=prefill,
            decode_nodes=decode,
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            decode_reuse=decode_reuse,
            transfer_timeout_s=30.0,
        )
    )


def launch_aggregated(
    model: str,
    replicas: int,
    tracing: bool = False,
    stream_interval: int = 1,
    stream_worker: bool | None = None,
    **engine: object,
):
    ensure_ray()
    engine_args = EngineArgs(model=model, device="cpu", **engine)
    return Cluster.launch(
        ClusterConfig(
            engine=engine_args,
            aggregated=True,
            replicas=replicas,
            enable_tracing=tracing,
            stream_interval=stream_interval,
            stream_worker=stream_worker,
        )
    )


def serve(cluster: Cluster, api_key: str | None = None) -> BackgroundServer:
    return BackgroundServer(create_app(cluster.router, api_key=api_key)).start()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()
