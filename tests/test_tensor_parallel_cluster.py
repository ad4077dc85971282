"""Aggregated replicas of 2 tensor parallel ranks in a CPU cluster (`--tp 2 --aggregated`): greedy
output through the router equals the offline engine's, and a rank killed outright fails its
node, whose requests end with an error naming the node, and the supervisor replaces the whole
node (its new ranks serving the same output). `--tp` reaches every node kind, and
`--prefill-tp` / `--decode-tp` override it per role (tests/test_tensor_parallel_transfer.py
runs such clusters)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from healing_helpers import launch_healing_cluster, one_request, wait_for_node
from rank_processes import follower_ranks, router_tokens
from tiny_models import make_tiny_llama

from cluster.commands.cli import build_parser
from cluster.deploy.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.loading.loader import EngineArgs

# Heads 4 and KV heads 2 (tiny_models' defaults): each rank holds half of both.
ENGINE = dict(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=8, tensor_parallel_size=2)
PROMPTS = [[5, 17, 99, 5, 40], [200, 201, 202, 7], [77] * 9 + [12, 13, 14, 15]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
RESTART_S = 120.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tp_cluster") / "model"
    make_tiny_llama(path, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def expected(model: str) -> list[list[int]]:
    with LLM(model, device="cpu") as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_a_replica_of_two_ranks_serves_the_offline_output_and_is_replaced_whole(model, expected):
    cluster = launch_healing_cluster(model, ENGINE, aggregated=True, replicas=1)
    try:
        router = cluster.router
        [rank] = follower_ranks(b"AggregatedNode")

        async def main():
            try:
                served = await router_tokens(router, "before", PROMPTS, GREEDY)
                os.kill(rank, signal.SIGKILL)
                failed_at = time.monotonic()
                failed = await one_request(router, "after-kill", PROMPTS[0], GREEDY)
                node = await wait_for_node(router, "replica-0", "ok", RESTART_S, restarts=1)
                again = await router_tokens(router, "replaced", PROMPTS, GREEDY)
                return served, failed, failed_at, node, again
            finally:
                await router.close()

        served, failed, failed_at, node, again = asyncio.run(main())
        assert served == expected
        # Killed between requests, the rank fails the next one or the node's probe first; either
        # way the request ends with an error naming the node, and soon.
        assert failed.error is not None and "replica-0" in failed.error, failed
        assert failed.ended - failed_at < 30.0
        assert node["restarts"] == 1
        assert again == expected
        [new_rank] = follower_ranks(b"AggregatedNode")
        assert new_rank != rank
    finally:
        cluster.shutdown()


def test_the_cli_passes_tp_to_every_node_and_per_role_overrides() -> None:
    args = build_parser().parse_args(["serve", "--aggregated", "--tp", "2", "--device", "cpu"])
    assert args.tensor_parallel_size == 2
    args = build_parser().parse_args(["serve", "--tp", "2", "--decode-tp", "1", "--device", "cpu"])
    assert (args.tensor_parallel_size, args.prefill_tp, args.decode_tp) == (2, None, 1)
    engine = EngineArgs(device="cpu", tensor_parallel_size=2)
    config = ClusterConfig(engine=engine, decode_tp=1)
    assert [config.tensor_parallel_size(r) for r in ("prefill", "decode")] == [2, 1]
    config = ClusterConfig(engine=engine, aggregated=True)
    assert config.tensor_parallel_size("replica") == 2
    with pytest.raises(ValueError, match="--prefill-tp sets a disaggregated node's ranks"):
        ClusterConfig(engine=engine, aggregated=True, prefill_tp=4)
