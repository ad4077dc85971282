"""A local cluster behind an API served on loopback listens on loopback only: Ray's GCS, raylet,
object manager, workers and agents, the nodes' control and data planes, the router and the HTTP
server. Read from /proc, so Linux only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from listening_sockets import descendants, listening_sockets

import cluster
from cluster.commands.cli import main
from cluster.deploy.config import ClusterConfig
from metadata.loopback import is_loopback

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"pdcluster serve exited with status {server.returncode}"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"pdcluster serve was not healthy within {timeout_s} s")


@pytest.fixture(scope="module")
def served(tiny_model_path):
    """`pdcluster serve` on loopback, as a user starts it: its own process, its own Ray."""
    port = free_port()
    command = [sys.executable, "-m", "cluster.commands.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--model", str(tiny_model_path), "--device", "cpu"]
    # The code under test, whatever the environment's installed copy of pdcluster is.
    repo = str(Path(cluster.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url)
        yield server, url, port
    finally:
        server.send_signal(signal.SIGTERM)  # drains, then stops the cluster and Ray
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_every_listening_socket_of_a_loopback_cluster_is_on_loopback(served):
    server, url, port = served
    # A request through every plane first, so that whatever listens lazily is listening.
    body = {"prompt": "Hello", "max_tokens": 4}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text

    # Ray's GCS, raylet and agents are started by the serve process, its workers (the nodes
    # among them) by the raylet.
    sockets = listening_sockets(descendants(server.pid))
    commands = " ".join(s.command for s in sockets)
    for component in ("gcs_server", "raylet", "RuntimeEnvAgent", "PrefillNode", "DecodeNode"):
        assert component in commands, f"no listening socket of {component} was found"
    assert any(s.pid == server.pid and s.port == port for s in sockets)  # the HTTP API
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
    import cluster.commands.serve

    served = []
    monkeypatch.setattr(cluster.commands.serve, "serve", served.append)
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    assert main(["serve", *flags]) == 0
    [config] = served
    assert config.cluster.loopback_only is loopback_only


def test_a_joined_cluster_cannot_be_loopback_only():
    with pytest.raises(ValueError, match="loopback"):
        ClusterConfig(ray_address="auto", loopback_only=True)
