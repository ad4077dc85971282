"""Nothing stranded: whatever a transfer fails on (injected before, during or after the KV send,
or stuck past its timeout), every request ends with an answer or an error naming the transfer,
and every pool ends empty; a stuck transfer's slots are held, with /health degraded, only until
its prefill node is replaced; the KV audit finds pools whose used slots no request holds. CPU
clusters over gloo, tiny models; faults injected through PDCLUSTER_FAULT_* (engine.env)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import ray
from cluster_helpers import wait_for
from healing_helpers import launch_healing_cluster, metric, one_request, wait_for_node
from tiny_models import make_tiny_llama

from cluster.deploy.launcher import Cluster
from engine import SamplingParams
from engine.env import FaultSettings, fault_settings
from metadata.faults import DECODE_FAULT_PHASES, PREFILL_FAULT_PHASES, FaultInjector
from metadata.kv_audit import KVAudit, PoolCount

ENGINE = dict(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=32)
SOAK_REQUESTS = 1000
FAIL_RATE = 0.05


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stranded") / "model"
    make_tiny_llama(path)
    return str(path)


def launch(model: str, **cluster: object) -> Cluster:
    return launch_healing_cluster(model, ENGINE, **cluster)


def test_injected_transfer_failures_lose_no_request_and_strand_no_slot(model, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_FAULT_TRANSFER_FAIL_RATE", str(FAIL_RATE))
    monkeypatch.setenv("PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE", "before,during,after")
    monkeypatch.setenv("PDCLUSTER_FAULT_SEED", "1")
    cluster = launch(model)
    try:
        router = cluster.router
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        prompts = [[1 + (i * 7 + j) % 250 for j in range(4 + i % 40)] for i in range(64)]

        async def main():
            limit = asyncio.Semaphore(24)

            async def one(i: int):
                async with limit:
                    return await one_request(router, f"r{i}", prompts[i % 64], params)

            try:
                outcomes = await asyncio.gather(*(one(i) for i in range(SOAK_REQUESTS)))
                return outcomes, (await router.metrics_text()).decode()
            finally:
                await router.close()

        outcomes, text = asyncio.run(main())
        served = [o for o in outcomes if o.error is None]
        failed = [o for o in outcomes if o.error is not None]
        assert len(served) + len(failed) == SOAK_REQUESTS
        assert all(o.tokens == 4 for o in served)
        assert all("transfer" in o.error for o in failed), {o.error for o in failed}
        # About 5 %: 50 of 1000 expected, from every phase.
        assert 20 <= len(failed) <= 90, len(failed)
        for phase in ("before the KV send", "room tag mismatch", "after it landed"):
            assert any(phase in o.error for o in failed), phase
        assert metric(text, "pdcluster_request_failures_total", kind="transfer") == len(failed)
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        for actor in cluster.prefill_actors + cluster.decode_actors:
            assert ray.get(actor.audit_kv.remote()) == []
        assert all(s["kv_audit_mismatches"] == 0 for s in cluster.node_stats())
    finally:
        cluster.shutdown()


def test_a_transfer_stuck_past_its_timeout_frees_its_slots_and_degrades_health(model, monkeypatch):
    """The prefill node never sends the transfer (a stall): the decode node's receive times
    out, the request ends naming the transfer, its slots are held (a posted receive cannot be
    cancelled) while /health says the decode node is degraded, then freed once the prefill
    node, the other end of the broken channel, is replaced."""
    monkeypatch.setenv("PDCLUSTER_FAULT_TRANSFER_FAIL_RATE", "1")
    monkeypatch.setenv("PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE", "stall")
    timeout_s = 2.0
    cluster = launch(model, transfer_timeout_s=timeout_s)
    try:
        router = cluster.router
        decode = cluster.decode_actors[0]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        seen: dict = {}

        async def watch_health() -> None:
            while True:
                health = await router.health()
                node = health["nodes"][1]
                if node["status"] == "degraded":
                    # The channel may show broken a probe before the slots show held (the
                    # receive's timeout breaks it on the transfer's thread, then the serving
                    # loop holds them), but it is reported broken, which has the prefill node
                    # replaced and the slots freed, only once they are held.
                    seen.setdefault("degraded", []).append(node["error"])
                await asyncio.sleep(0.02)

        async def main():
            watcher = asyncio.create_task(watch_health())
            try:
                started = time.monotonic()
                outcome = await one_request(router, "stuck", list(range(3, 40)), params)
                ended = time.monotonic() - started
                await wait_for_node(router, "prefill-0", "ok", 60, restarts=1)
                return outcome, ended, (await router.health())
            finally:
                watcher.cancel()
                await router.close()

        outcome, ended, health = asyncio.run(main())
        assert outcome.error is not None and "KV transfer from prefill-0 failed" in outcome.error
        assert f"did not complete the transfer within {timeout_s:g} s" in outcome.error
        assert timeout_s <= ended < timeout_s + 5
        # The cluster's status is "down" meanwhile: its only prefill node is being replaced.
        # The request's slots (its 37-token prompt and its first decode step) are held meanwhile.
        assert any("stuck past their timeout hold 38 KV slots" in e for e in seen["degraded"])
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        stats = ray.get(decode.stats.remote())
        assert stats["kv_used"] == 0 and stats["kv_quarantined"] == 0
        assert stats["transfers_in_flight"] == 0
        assert ray.get(decode.audit_kv.remote()) == []
        assert health["nodes"][1]["status"] == "ok"
    finally:
        cluster.shutdown()


def test_the_audit_counts_a_pool_whose_slots_no_request_holds():
    audit = KVAudit("decode-0", interval_s=0)
    assert audit.run([PoolCount("target", 10, 10), PoolCount("metadata_rows", 1, 1)]) == []
    wrong = audit.run([PoolCount("target", 21126, 0), PoolCount("draft-0", 5, 5)])
    assert wrong == [PoolCount("target", 21126, 0)]
    assert audit.stats() == {"kv_audits": 2, "kv_audit_mismatches": 1, "kv_unaccounted": 21126}


def test_fault_settings_are_off_by_default_and_validated():
    assert not fault_settings({}).any
    settings = fault_settings(
        {
            "PDCLUSTER_FAULT_TRANSFER_FAIL_RATE": "0.5",
            "PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE": "before, after",
            "PDCLUSTER_FAULT_KILL_AFTER_REQUESTS": "3",
        }
    )
    assert settings == FaultSettings(0.5, ("before", "after"), 3, 0)
    for bad in (
        {"PDCLUSTER_FAULT_TRANSFER_FAIL_RATE": "2"},
        {"PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE": "sometimes"},
        {"PDCLUSTER_FAULT_KILL_AFTER_REQUESTS": "-1"},
    ):
        with pytest.raises(ValueError, match="PDCLUSTER_FAULT"):
            fault_settings(bad)


def test_each_side_injects_its_share_of_the_rate():
    """The prefill node injects before/during/stall and the decode node after: drawn so that
    the share of failing transfers is the configured rate in all."""
    settings = FaultSettings(0.3, ("before", "after"))
    prefill, decode = FaultInjector("prefill-0", settings), FaultInjector("decode-0", settings)
    draws = 20000
    phases = Counter()
    for _ in range(draws):
        # The decode node draws only for transfers that reached it.
        phase = prefill.transfer_fault(PREFILL_FAULT_PHASES) or decode.transfer_fault(
            DECODE_FAULT_PHASES, earlier=PREFILL_FAULT_PHASES
        )
        phases[phase] += 1
    assert abs((draws - phases[None]) / draws - 0.3) < 0.015
    assert abs(phases["before"] - phases["after"]) / draws < 0.015


def test_a_node_launched_without_faults_clears_those_its_ray_instance_started_with(monkeypatch):
    """Ray merges an actor's environment into the one its job started with: the launcher
    sets every fault variable, empty where the driver has none, so a cluster launched after a
    faulty one in the same process (and Ray instance) injects nothing."""
    from cluster.deploy.ray_start import forwarded_env
    from engine.env import FAULT_ENV_VARS

    for name in FAULT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    env = forwarded_env()
    assert {name: env[name] for name in FAULT_ENV_VARS} == dict.fromkeys(FAULT_ENV_VARS, "")
    assert not fault_settings(env).any
    monkeypatch.setenv("PDCLUSTER_FAULT_TRANSFER_FAIL_RATE", "0.25")
    assert fault_settings(forwarded_env()).transfer_fail_rate == 0.25
