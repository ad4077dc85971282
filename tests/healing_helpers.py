"""Driving a cluster through node deaths in tests: a stream of requests that records how each
one ended, and waits on the router's view of a node."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cluster_helpers import ensure_ray

from cluster.control.router import Router
from cluster.deploy.config import ClusterConfig
from cluster.deploy.launcher import Cluster
from cluster.frontend.backend import BackendError
from engine import SamplingParams
from engine.loading.loader import EngineArgs


@dataclass
class Outcome:
    started: float
    ended: float
    tokens: int = 0
    error: str | None = None
    usage: dict | None = None  # the finished request's (it names its nodes)


@dataclass
class RequestStream:
    """`workers` concurrent clients, each sending one request after the other until stopped."""

    router: Router
    prompt: list[int]
    params: SamplingParams
    workers: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: bool = False
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.workers)]

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)

    def in_flight_at(self, moment: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started < moment < o.ended]

    async def _client(self, worker: int) -> None:
        count = 0
        while not self._stop:
            count += 1
            outcome = await one_request(self.router, f"w{worker}-{count}", self.prompt, self.params)
            self.outcomes.append(outcome)
            if outcome.error is not None:
                await asyncio.sleep(0.05)  # a node down answers at once: do not spin


async def one_request(
    router: Router, name: str, prompt: list[int], params: SamplingParams
) -> Outcome:
    started = time.monotonic()
    tokens, usage = 0, None
    try:
        async for delta in router.generate(name, prompt, params):
            tokens += len(delta.token_ids)
            usage = delta.usage or usage
    except BackendError as err:
        return Outcome(started, time.monotonic(), tokens, str(err))
    return Outcome(started, time.monotonic(), tokens, usage=usage)


async def wait_for_node(
    router: Router, name: str, status: str, timeout_s: float, restarts: int | None = None
) -> dict:
    """The node's /health entry once its status is `status` (after `restarts` restarts, if
    given); fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = await router.health()
        node = next(n for n in health["nodes"] if n["name"] == name)
        if node["status"] == status and restarts in (None, node["restarts"]):
            return node
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} not {status} within {timeout_s} s: {health}")
        await asyncio.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus exposition `text`, or None."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{wanted}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return None


def launch_healing_cluster(model: str, engine: dict, **cluster: object) -> Cluster:
    """A CPU cluster that heals fast: short transfer timeout, restart backoff and audit
    interval (any of them overridden by `cluster`)."""
    ensure_ray()
    config = dict(transfer_timeout_s=30.0, node_restart_backoff_s=0.2, kv_audit_interval_s=1.0)
    config.update(cluster)
    return Cluster.launch(
        ClusterConfig(engine=EngineArgs(model=model, device="cpu", **engine), **config)
    )
