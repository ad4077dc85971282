"""KV transfer between prefill and decode nodes of different tensor parallel sizes, on CPU with
gloo, per rank (metadata.rank_kv, engine/tensor_parallel/kv_links.py): clusters P(TP 2) ->
D(TP 1), P(TP 1) -> D(TP 2), P(TP 2) -> D(TP 2) and P(TP 4) -> D(TP 2) serve the offline
one-rank engine's greedy output through the router (a prompt longer than the prefill chunk
among them, and a conversation's second turn whose transfer leaves out what the decode node
holds already), with every pool empty afterwards and clean KV audits; the node channel carries
only the KV heads prefill rank 0 sends decode rank 0, and every other decode rank's heads land
through its own link from the prefill rank the routes name, exactly its heads' bytes;
speculating pairs P(TP 2) -> D(TP 1) and P(TP 1) -> D(TP 2) are lossless (the draft is rank
0's alone). The pairing check speaks of the whole model's KV heads with each side's size, so
nodes of different sizes pair, and a size that cannot hold the KV heads, or a model of other
KV heads, is refused by name. A decode rank killed mid-request ends the request with an error
naming the node and the rank."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
import torch
from cluster_helpers import ensure_ray, wait_for
from healing_helpers import launch_healing_cluster, wait_for_node
from rank_processes import follower_ranks, router_tokens
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

from cluster.deploy.config import ClusterConfig
from cluster.deploy.launcher import Cluster
from cluster.frontend.backend import BackendError
from engine import LLM, SamplingParams
from engine.loading.loader import EngineArgs, resolve
from metadata.buffers import MetadataBuffers
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


# One KV head of one token of the tiny model: 2 layers, K and V, head_dim 16, float32.
HEAD_BYTES = 2 * 2 * 16 * 4
# The metadata row of a transfer that does not draft (hidden size 64, float32).
ROW_BYTES = MetadataBuffers(1, 64, 0, 1, torch.float32, "cpu", boundary_width=64).row_nbytes
# Per pairing: the KV heads the node channel carries (prefill rank 0 to decode rank 0), the
# bytes per token each other route lands (one head each), and what prefill rank 0 sends
# through its own links, by decode rank.
ROUTES = {
    # Decode rank 0 holds both heads: head 1 comes from prefill rank 1.
    (2, 1): (1, {"prefill 1 -> decode 0": HEAD_BYTES}, {}),
    # Prefill rank 0 holds both heads: it sends head 1 to decode rank 1 itself.
    (1, 2): (1, {"prefill 0 -> decode 1": HEAD_BYTES}, {1: HEAD_BYTES}),
    (2, 2): (1, {"prefill 1 -> decode 1": HEAD_BYTES}, {}),
    # Prefill ranks 2 and 3 both hold head 1: rank 3 alone sends it; ranks 1 and 2 send none.
    (4, 2): (1, {"prefill 3 -> decode 1": HEAD_BYTES}, {}),
}


def _stats(cluster: Cluster, role: str) -> dict:
    [stats] = [s for s in cluster.node_stats() if s["node"].startswith(role)]
    return stats


def _decode_transfers(cluster: Cluster) -> dict:
    return _stats(cluster, "d")["transfers"]


def _check_each_rank_got_its_own_heads(cluster: Cluster, prefill_tp: int, decode_tp: int):
    """The bytes of every transfer so far, by the way they crossed."""
    node_heads, per_route, rank0_sent = ROUTES[(prefill_tp, decode_tp)]
    decode, prefill = _stats(cluster, "d"), _stats(cluster, "p")
    tokens, count = decode["transfers"]["kv_tokens"], decode["transfers"]["count"]
    # The node channel: route (0, 0)'s heads and the metadata row, never every head.
    node_bytes = tokens * node_heads * HEAD_BYTES + count * ROW_BYTES
    assert decode["transfers"]["bytes"] == node_bytes
    assert prefill["transfers"]["bytes"] == node_bytes
    # Every other decode rank's heads, through its own link from the prefill rank that the
    # routes name (a follower, but where prefill rank 0 holds them).
    assert decode["rank_kv"]["landed"] == {r: tokens * n for r, n in per_route.items()}
    assert prefill["rank_kv"]["sent"] == {d: tokens * n for d, n in rank0_sent.items()}


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
        _check_each_rank_got_its_own_heads(cluster, prefill_tp, decode_tp)
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        for actor in cluster.prefill_actors + cluster.decode_actors:
            assert ray.get(actor.audit_kv.remote()) == []
    finally:
        cluster.shutdown()


def test_the_pairing_check_speaks_of_the_whole_models_kv_heads(model) -> None:
    """Nodes of 1, 2 and 4 ranks describe the same KV in the model's terms, each with its own
    size, and pair in any direction; a size that cannot hold the model's KV heads, or another
    count of KV heads, is refused by name."""

    def spec_of(ranks: int):
        args = EngineArgs(model=model, device="cpu", tensor_parallel_size=ranks, **ENGINE)
        return transfer_spec(resolve(args, f"node-tp{ranks}", None))

    one, two, four = spec_of(1), spec_of(2), spec_of(4)
    assert [spec.tp_size for spec in (one, two, four)] == [1, 2, 4]
    assert dataclasses.replace(two, tp_size=1) == dataclasses.replace(four, tp_size=1) == one
    assert two.num_kv_heads == 2
    for prefill, decode in [(two, one), (one, two), (four, two), (two, four)]:
        check_compatible(prefill, decode)
    # 3 ranks would hold 2 KV heads neither split nor replicated whole: no route serves it.
    three = dataclasses.replace(one, tp_size=3)
    with pytest.raises(PairingError) as err:
        check_compatible(two, three)
    assert str(err.value) == (
        "prefill node and decode node cannot pair: decode tp_size 3 neither divides "
        "num_kv_heads 2 nor is a multiple of it"
    )
    other = dataclasses.replace(one, num_kv_heads=4)
    with pytest.raises(PairingError, match="num_kv_heads 2 != 4"):
        check_compatible(two, other)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_speculating_pair_with_ranks_is_lossless(tmp_path, prefill_tp, decode_tp):
    """The draft runs on rank 0 alone, whole: its depths' KV and the metadata row cross as with
    one rank, on the node channel beside route (0, 0)'s heads of the target."""
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


def test_a_decode_rank_killed_mid_request_ends_it_with_an_error_naming_node_and_rank(model):
    cluster = launch_healing_cluster(model, ENGINE, prefill_tp=1, decode_tp=2)
    # Long enough to be running when the rank goes (the context holds the prompt and these).
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    try:
        router = cluster.router
        [rank] = follower_ranks(b"DecodeNode")

        async def main():
            running = asyncio.Event()

            async def consume() -> tuple[int, str | None]:
                tokens = 0
                try:
                    async for delta in router.generate("mid", PROMPTS[0], long):
                        tokens += len(delta.token_ids)
                        if tokens >= 3:
                            running.set()
                except BackendError as err:
                    return tokens, str(err)
                return tokens, None

            try:
                stream = asyncio.create_task(consume())
                await asyncio.wait_for(running.wait(), 60)
                os.kill(rank, signal.SIGKILL)
                tokens, error = await asyncio.wait_for(stream, 60)
                await wait_for_node(router, "decode-0", "ok", RESTART_S, restarts=1)
                return tokens, error
            finally:
                await router.close()

        tokens, error = asyncio.run(main())
        assert tokens < long.max_tokens and error is not None
        assert "decode-0" in error and "rank 1" in error, error
    finally:
        cluster.shutdown()
