"""A local cluster behind an API served on loopback listens on loopback only: Ray's GCS, raylet,
object manager, workers and agents, the nodes' control and data planes, the router and the HTTP
server. Read from /proc, so Linux only."""

from __future__ import annotations

import os
import sys

import httpx
import pytest
import ray
from listening_sockets import descendants, listening_sockets

from cluster.cli import main
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from cluster.openai_api import BackgroundServer, create_app
from engine.loader import EngineArgs
from metadata.loopback import is_loopback

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture(scope="module")
def loopback_cluster(tiny_model_path):
    # Launch starts (and shutdown stops) its own Ray instance only when none is running; the
    # one other tests share listens on every interface.
    if ray.is_initialized():
        ray.shutdown()
    engine = EngineArgs(model=str(tiny_model_path), device="cpu")
    cluster = Cluster.launch(ClusterConfig(engine=engine, loopback_only=True))
    assert cluster.started_ray
    server = BackgroundServer(create_app(cluster.router), host="127.0.0.1").start()
    try:
        yield cluster, server
    finally:
        server.stop()
        cluster.shutdown()


def node_pids(cluster: Cluster) -> set[int]:
    actors = cluster.prefill_actors + cluster.decode_actors
    return set(ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors]))


def test_every_listening_socket_of_a_loopback_cluster_is_on_loopback(loopback_cluster):
    cluster, server = loopback_cluster
    # A request through every plane first, so that whatever listens lazily is listening.
    body = {"prompt": "Hello", "max_tokens": 4}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text

    # Ray starts its GCS, raylet and agents from this process, and workers from the raylet.
    processes = descendants(os.getpid())
    assert node_pids(cluster) <= processes
    sockets = listening_sockets(processes)
    commands = " ".join(s.command for s in sockets)
    for component in ("gcs_server", "raylet", "RuntimeEnvAgent", "PrefillNode", "DecodeNode"):
        assert component in commands, f"no listening socket of {component} was found"
    assert any(s.port == server.port and s.pid == os.getpid() for s in sockets)
    # An IPv6 socket bound to 127.0.0.1 shows as ::ffff:127.0.0.1, which is_loopback takes.
    exposed = [s for s in sockets if not is_loopback(s.address)]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(
        f"  {s.address}:{s.port} pid {s.pid} {s.command[:120]}" for s in exposed
    )


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.2", False),
        ("example.com", False),
    ],
)
def test_loopback_hosts(host, expected):
    assert is_loopback(host) is expected


@pytest.mark.parametrize(
    "flags, loopback_only",
    [
        ([], True),  # --host defaults to 127.0.0.1
        (["--host", "0.0.0.0"], False),
        (["--ray-address", "auto"], False),  # a joined cluster's hosts must reach one another
    ],
)
def test_serve_asks_for_loopback_only_when_the_api_is_local(monkeypatch, flags, loopback_only):
    import cluster.serve

    served = []
    monkeypatch.setattr(cluster.serve, "serve", served.append)
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    assert main(["serve", *flags]) == 0
    [config] = served
    assert config.cluster.loopback_only is loopback_only


def test_a_joined_cluster_cannot_be_loopback_only():
    with pytest.raises(ValueError, match="loopback"):
        ClusterConfig(ray_address="auto", loopback_only=True)
