"""A cluster of Ray nodes on this machine (ray.cluster_utils): a head and two workers, one that
carries the `prefill` resource and one the `decode` resource. pdcluster joins it, places each node
actor on the host of its role, serves through the HTTP API, and stops without leaving actors; a
cluster too small for what is asked fails at once, naming the missing resource."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_helpers import wait_for
from tiny_models import make_tiny_llama

from cluster.client import Client
from cluster.deploy.config import ClusterConfig
from cluster.deploy.launcher import Cluster, ClusterStartError, init_ray
from cluster.deploy.node_factory import node_resources
from cluster.deploy.placement import role_demands, shortfall
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM, SamplingParams
from engine.loading.loader import EngineArgs

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

ENGINE = dict(max_model_len=128, kv_cache_tokens=1024, max_num_seqs=8)
NODE_CLASSES = {"PrefillNode", "DecodeNode"}
PROMPTS = ["hello there", "the quick brown fox"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-multinode")
    make_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def ray_cluster():
    # Another test module may have started a local Ray in this process: this module needs its own.
    if ray.is_initialized():
        ray.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    hosts = {
        "prefill": cluster.add_node(num_cpus=1, resources={"prefill": 1}),
        "decode": cluster.add_node(num_cpus=1, resources={"decode": 1}),
    }
    cluster.wait_for_nodes()
    init_ray(cluster.address)
    try:
        yield cluster, {role: node.node_id for role, node in hosts.items()}
    finally:
        ray.shutdown()
        cluster.shutdown()


def config_for(model: str, address: str, **overrides: object) -> ClusterConfig:
    return ClusterConfig(
        engine=EngineArgs(model=model, device="cpu", **ENGINE),
        ray_address=address,
        transfer_timeout_s=30.0,
        startup_timeout_s=120.0,
        **overrides,
    )


@dataclass(frozen=True)
class LiveNode:
    class_name: str
    node_id: str


def alive_nodes() -> list[LiveNode]:
    """Every live pdcluster node actor and the Ray node it runs on, read from the GCS:
    ray.util.state would need the dashboard, which a plain `ray` install does not run."""
    actors = ray._private.state.actors().values()
    return [
        LiveNode(a["ActorClassName"], a["Address"]["NodeID"])
        for a in actors
        if a["State"] == "ALIVE" and a["ActorClassName"] in NODE_CLASSES
    ]


def test_nodes_run_on_the_hosts_of_their_role_and_serve(ray_cluster, tiny_model):
    cluster_, node_ids = ray_cluster
    cluster = Cluster.launch(config_for(tiny_model, cluster_.address))
    try:
        placed = {a.class_name: a.node_id for a in alive_nodes()}
        assert placed == {"PrefillNode": node_ids["prefill"], "DecodeNode": node_ids["decode"]}
        # Joined to a cluster, each node binds the address of its own host, never loopback.
        node_ip = ray.util.get_node_ip_address()
        for node in cluster.router.prefill_nodes + cluster.router.decode_nodes:
            assert node.endpoint.startswith(f"tcp://{node_ip}:")
        expected = LLM(tiny_model, device="cpu", **ENGINE).generate(
            PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
        server = BackgroundServer(create_app(cluster.router)).start()
        try:
            with Client(server.url) as client:
                for prompt, ref in zip(PROMPTS, expected):
                    out = client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
                    assert out.token_ids == ref.token_ids
                    assert out.text == ref.text
        finally:
            server.stop()
    finally:
        cluster.shutdown()
    assert ray.is_initialized(), "a cluster joined by the caller leaves the caller's Ray alone"
    assert wait_for(lambda: not alive_nodes(), timeout_s=30)


def test_too_few_role_hosts_fail_at_once_naming_the_resource(ray_cluster, tiny_model):
    cluster_, _ = ray_cluster
    started = time.monotonic()
    with pytest.raises(ClusterStartError) as err:
        Cluster.launch(config_for(tiny_model, cluster_.address, decode_nodes=2))
    assert time.monotonic() - started < 15
    message = str(err.value)
    assert "2 decode nodes with {'decode': 1, 'CPU': 0.01} each" in message
    assert "the cluster has decode=1" in message
    assert not alive_nodes()
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def test_launch_waits_for_a_role_host_that_joins_late(ray_cluster, tiny_model, caplog):
    cluster_, node_ids = ray_cluster
    caplog.set_level(logging.INFO, logger="cluster.deploy.placement")
    config = config_for(tiny_model, cluster_.address, decode_nodes=2, node_wait_s=60)
    launched: dict = {}

    def launch() -> None:
        try:
            launched["cluster"] = Cluster.launch(config)
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            launched["error"] = err

    launcher = threading.Thread(target=launch)
    launcher.start()
    late_node = None
    try:
        assert wait_for(lambda: "waiting up to 60 s" in caplog.text, timeout_s=30)
        # Ray starts nodes from the main thread only.
        late_node = cluster_.add_node(num_cpus=1, resources={"decode": 1})
        launcher.join(timeout=120)
        assert "cluster" in launched, launched.get("error")
        cluster = launched["cluster"]
        try:
            decode_hosts = {a.node_id for a in alive_nodes() if a.class_name == "DecodeNode"}
            assert decode_hosts == {node_ids["decode"], late_node.node_id}
        finally:
            cluster.shutdown()
        assert wait_for(lambda: not alive_nodes(), timeout_s=30)
    finally:
        launcher.join(timeout=120)
        if late_node is not None:
            cluster_.remove_node(late_node)


def test_bundles_ask_for_a_role_resource_only_where_the_cluster_declares_it():
    config = ClusterConfig(prefill_nodes=2, decode_nodes=2)
    gpus_only = {"GPU": 8.0, "CPU": 64.0}
    assert [d.bundle for d in role_demands(config, True, gpus_only)] == [
        {"GPU": 1, "CPU": 1},
        {"GPU": 1, "CPU": 1},
    ]
    assert shortfall(role_demands(config, True, gpus_only), gpus_only) is None
    with_roles = {**gpus_only, "prefill": 4.0, "decode": 1.0}
    demands = role_demands(config, True, with_roles)
    assert [d.bundle for d in demands] == [
        {"prefill": 1, "GPU": 1, "CPU": 1},
        {"decode": 1, "GPU": 1, "CPU": 1},
    ]
    assert shortfall(demands, with_roles) == (
        "asked for 2 decode nodes with {'decode': 1, 'GPU': 1, 'CPU': 1} each; "
        "the cluster has decode=1 in all"
    )
    # Half a GPU each: a prefill and a decode node fit on one GPU; replicas ask for no role.
    shared = ClusterConfig(gpus_per_node=0.5)
    one_gpu = {"GPU": 1.0, "CPU": 16.0}
    assert [d.bundle for d in role_demands(shared, True, one_gpu)] == [
        {"GPU": 0.5, "CPU": 1},
        {"GPU": 0.5, "CPU": 1},
    ]
    assert shortfall(role_demands(shared, True, one_gpu), one_gpu) is None
    replicas = ClusterConfig(aggregated=True, replicas=3)
    [demand] = role_demands(replicas, True, with_roles)
    assert (demand.role, demand.count, demand.bundle) == ("replica", 3, {"GPU": 1, "CPU": 1})
    renamed = ClusterConfig(prefill_resource="ingest", decode_resource="")
    assert [d.bundle for d in role_demands(renamed, False, {"ingest": 1, "decode": 1})] == [
        {"ingest": 1, "CPU": 0.01},
        {"CPU": 0.01},
    ]
    assert "GPU=2" in shortfall(role_demands(config, True, {"GPU": 2}), {"GPU": 2})


def test_a_nodes_bundle_holds_all_its_tensor_parallel_ranks():
    """A node of N ranks asks for N ranks' resources in its one bundle (one host): a GPU and
    a core each on GPU, a sliver each on CPU; its actor asks for the same."""
    config = ClusterConfig(prefill_nodes=1, decode_nodes=2, prefill_tp=4, decode_tp=2)
    gpus = {"GPU": 8.0, "CPU": 64.0}
    assert [(d.role, d.count, d.bundle) for d in role_demands(config, True, gpus)] == [
        ("prefill", 1, {"GPU": 4, "CPU": 4}),
        ("decode", 2, {"GPU": 2, "CPU": 2}),
    ]
    assert shortfall(role_demands(config, True, gpus), gpus) is None
    assert "GPU=7" in shortfall(role_demands(config, True, {**gpus, "GPU": 7}), {"GPU": 7})
    assert [d.bundle for d in role_demands(config, False, {"CPU": 2})] == [
        {"CPU": 0.04},
        {"CPU": 0.02},
    ]
    replicas = ClusterConfig(aggregated=True, replicas=2, engine=EngineArgs(tensor_parallel_size=2))
    [demand] = role_demands(replicas, True, gpus)
    assert (demand.count, demand.bundle) == (2, {"GPU": 2, "CPU": 2})
    assert node_resources(config, "decode", True) == {"GPU": 2, "CPU": 2}


def test_pdcluster_serve_joins_the_cluster_and_stops_on_sigint(ray_cluster, tiny_model, tmp_path):
    cluster_, _ = ray_cluster
    port = _free_port()
    log_path = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "cluster.commands.cli", "serve",
        "--ray-address", cluster_.address,
        "--model", tiny_model,
        "--device", "cpu",
        "--port", str(port),
        "--max-model-len", str(ENGINE["max_model_len"]),
        "--kv-cache-tokens", str(ENGINE["kv_cache_tokens"]),
        "--max-num-seqs", str(ENGINE["max_num_seqs"]),
    ]  # fmt: skip
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        with Client(f"http://127.0.0.1:{port}", timeout=30) as client:
            assert wait_for(lambda: _healthy(client, server), timeout_s=90), log_path.read_text()
            out = client.generate(PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True)
            assert len(out.token_ids) == 8
            assert len(alive_nodes()) == 2
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    output = log_path.read_text()
    assert code in (0, 130), output  # 130: the conventional status after Ctrl-C
    assert "stopping the cluster" in output
    assert "Traceback" not in output, output
    assert wait_for(lambda: not alive_nodes(), timeout_s=30)


def _healthy(client: Client, server: subprocess.Popen) -> bool:
    if server.poll() is not None:
        raise AssertionError(f"pdcluster serve exited early with status {server.returncode}")
    try:
        return client.health().get("status") == "ok"
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_engines_sharing_a_gpu_size_their_kv_from_their_share(monkeypatch):
    """Two nodes on one GPU start together: each keeps to its share of the total, whatever the
    other had taken when it measured the free memory."""
    from types import SimpleNamespace

    import torch

    from engine.loading import loader

    config = SimpleNamespace(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        moe=None,
    )
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    per_token = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x kv heads x head dim x bf16 bytes
    weights = loader._weight_bytes(config, torch.bfloat16)
    whole = loader._default_kv_tokens(config, torch.bfloat16, "cuda:0")
    assert whole == (int(60 * gib * loader.DEFAULT_GPU_KV_FRACTION) - weights) // per_token
    half = loader._default_kv_tokens(config, torch.bfloat16, "cuda:0", utilization=0.5)
    assert half == (int(40 * gib * loader.DEFAULT_GPU_KV_FRACTION) - weights) // per_token
    # A share larger than what is free takes what is free.
    most = loader._default_kv_tokens(config, torch.bfloat16, "cuda:0", utilization=0.9)
    assert most == whole
