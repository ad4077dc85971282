"""KV transfer between prefill and decode nodes of different tensor parallel sizes, on CPU with
gloo (metadata.whole_kv, engine/tensor_parallel/kv_exchange.py): clusters P(TP 2) -> D(TP 1),
P(TP 1) -> D(TP 2), P(TP 2) -> D(TP 2) and P(TP 4) -> D(TP 2) serve the offline one-rank
engine's greedy output through the router (a prompt longer than the prefill chunk among them,
and a conversation's second turn whose transfer leaves out what the decode node holds
already), with every pool empty afterwards and clean KV audits; speculating pairs P(TP 2) ->
D(TP 1) and P(TP 1) -> D(TP 2) are lossless (the draft is rank 0's alone). The pairing check
speaks of the whole model's KV heads, so nodes of different sizes pair, and a model of other
KV heads is refused by name."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
from cluster_helpers import ensure_ray, wait_for
from healing_helpers import launch_healing_cluster, wait_for_node
from rank_processes import follower_ranks, router_tokens
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from engine import LLM, SamplingParams
from engine.loader import EngineArgs, resolve
from metadata.handshake import PairingError, check_compatible
from metadata.node_common import transfer_spec

ray = pytest.importorskip("ray")

# Heads 4 and KV heads 2 (tiny_models' defaults): two ranks hold one KV head each.
CHUNK = 16
ENGINE = dict(max_model_len=256, kv_cache_tokens=1024, max_num_seqs=8, chunked_prefill_size=CHUNK)
PROMPTS = [
    [5, 17, 99, 5, 40],
    [200, 201, 202, 7],
    [(7 * i) % 300 + 3 for i in range(CHUNK * 2 + 5)],
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# A second turn: the first prompt, its answer and a new message, on the same decode node.
NEXT = [61, 62, 63]
RESTART_S = 120.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tp_transfer") / "model"
    make_tiny_llama(path, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def offline(model: str):
    with LLM(model, device="cpu", enable_prefix_cache=False, **ENGINE) as llm:
        first = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        second = PROMPTS[0] + first[0] + NEXT
        return first, second, llm.generate([second], GREEDY)[0].token_ids


def _decode_transfers(cluster: Cluster) -> dict:
    [stats] = [s for s in cluster.node_stats() if s["node"].startswith("d")]
    return stats["transfers"]


# (4, 2): the prefill node's 4 ranks replicate each KV head; each is sent once.
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_nodes_of_any_sizes_serve_the_offline_output(model, offline, prefill_tp, decode_tp):
    first, second, second_expected = offline
    ensure_ray()
    config = ClusterConfig(
        engine=EngineArgs(model=model, device="cpu", **ENGINE),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        transfer_timeout_s=30.0,
    )
    cluster = Cluster.launch(config)
    try:
        router = cluster.router

        async def main():
            try:
                served = await router_tokens(router, "first", PROMPTS, GREEDY)
                before = _decode_transfers(cluster)
                [again] = await router_tokens(router, "second", [second], GREEDY)
                return served, before, again
            finally:
                await router.close()

        served, before, again = asyncio.run(main())
        assert served == first
        assert again == second_expected
        after = _decode_transfers(cluster)
        # The second turn's transfer left out the positions the decode node held (all of the
        # first turn but its answer's last token, whose KV no step computed).
        reused = after["reused_tokens"] - before["reused_tokens"]
        assert reused == len(PROMPTS[0]) + len(first[0]) - 1
        assert after["kv_tokens"] - before["kv_tokens"] == len(second) - reused
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        for actor in cluster.prefill_actors + cluster.decode_actors:
            assert ray.get(actor.audit_kv.remote()) == []
    finally:
        cluster.shutdown()


def test_the_pairing_check_speaks_of_the_whole_models_kv_heads(model) -> None:
    """Nodes of 1 and 2 ranks describe the same KV on the wire; another count of KV heads is
    refused by name (whole heads cross, so no head count can be made to fit another)."""

    def spec_of(ranks: int):
        args = EngineArgs(model=model, device="cpu", tensor_parallel_size=ranks, **ENGINE)
        return transfer_spec(resolve(args, f"node-tp{ranks}", None))

    one, two, four = spec_of(1), spec_of(2), spec_of(4)
    assert one == two == four and two.num_kv_heads == 2
    check_compatible(two, one)
    other = dataclasses.replace(one, num_kv_heads=4)
    with pytest.raises(PairingError, match="num_kv_heads 2 != 4"):
        check_compatible(two, other)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_speculating_pair_with_ranks_is_lossless(tmp_path, prefill_tp, decode_tp):
    """The draft runs on rank 0 alone, whole: its depths' KV and the metadata row cross as with
    one rank, beside the target's whole heads."""
    make_predictable_llama(tmp_path / "target", seed=0)
    make_good_draft(tmp_path / "good", tmp_path / "target", 4, noise=0.01)
    target = str(tmp_path / "target")
    spec = dict(
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(tmp_path / "good"),
        num_draft_steps=3,
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with LLM(target, device="cpu", **ENGINE) as llm:
        expected = [out.token_ids for out in llm.generate(PROMPTS, params)]
    ensure_ray()
    config = ClusterConfig(
        engine=EngineArgs(model=target, device="cpu", **ENGINE, **spec),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        transfer_timeout_s=30.0,
    )
    cluster = Cluster.launch(config)
    try:
        router = cluster.router

        async def main():
            outputs = []
            try:
                for i, prompt in enumerate(PROMPTS):
                    tokens, usage = [], None
                    async for delta in router.generate(f"spec{i}", prompt, params):
                        tokens += delta.token_ids
                        usage = delta.usage or usage
                    outputs.append((tokens, usage))
            finally:
                await router.close()
            return outputs

        outputs = asyncio.run(main())
        assert [tokens for tokens, _ in outputs] == expected
        accepted = sum(
            u["completion_tokens_details"]["accepted_prediction_tokens"] for _, u in outputs
        )
        assert accepted > 0
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        for actor in cluster.prefill_actors + cluster.decode_actors:
            assert ray.get(actor.audit_kv.remote()) == []
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("role, prefill_tp, decode_tp", [("prefill", 2, 1), ("decode", 1, 2)])
def test_a_rank_killed_while_idle_fails_its_node_which_is_replaced_whole(
    model, offline, role, prefill_tp, decode_tp
):
    first, _, _ = offline
    node_name = f"{role}-0"
    cluster = launch_healing_cluster(model, ENGINE, prefill_tp=prefill_tp, decode_tp=decode_tp)
    actor_class = b"PrefillNode" if role == "prefill" else b"DecodeNode"
    try:
        router = cluster.router
        [rank] = follower_ranks(actor_class)

        async def main():
            try:
                served = await router_tokens(router, "before", PROMPTS[:1], GREEDY)
                # Killed while the node is idle: its health probe alone reports the lost rank.
                os.kill(rank, signal.SIGKILL)
                node = await wait_for_node(router, node_name, "ok", RESTART_S, restarts=1)
                again = await router_tokens(router, "replaced", PROMPTS, GREEDY)
                return served, node, again
            finally:
                await router.close()

        served, node, again = asyncio.run(main())
        assert served == first[:1]
        assert node["restarts"] == 1
        assert again == first
        [new_rank] = follower_ranks(actor_class)
        assert new_rank != rank
    finally:
        cluster.shutdown()
