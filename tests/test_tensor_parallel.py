"""Tensor parallelism inside the offline engine (engine/tensor_parallel/), on CPU with gloo:
greedy output of 2 and 4 ranks token-exact against one rank and against transformers (with KV
heads split at 2 ranks and replicated at 4, biases on every projection, a vocabulary that 4 ranks
split with padding, chunked prefill, penalties, a grammar); each rank's KV pool holds only its
KV heads, and a request's KV crosses between engines of any sizes rank by rank; a model or
option the ranks cannot split is refused naming the mismatch; and no rank outlives its engine
(closed, collected, or its process killed). Gemma 3 at 2 ranks covers tied embeddings, q/k
norms, sandwich norms, sliding windows and soft-capped logits."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cluster_helpers import wait_for
from family_checks import hf_greedy
from tiny_families import make_tiny_family
from tiny_models import make_tiny_llama
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.errors import PdclusterError, TensorParallelError
from engine.loading.weights import load_hf_config
from engine.model_config import ModelConfig
from engine.sampling.grammar import grammar_library_available, json_schema_grammar
from engine.scheduling.kv_pool import KVPool
from engine.tensor_parallel.group import RankGroup
from engine.tensor_parallel.kv_links import KVLinks, LinkPlan, LinkSpec, slot_index
from engine.tensor_parallel.kv_routes import KVRoute
from engine.tensor_parallel.layout import (
    TensorParallelLayout,
    check_tensor_parallel,
    check_tensor_parallel_options,
)
from engine.tensor_parallel.link_orders import (
    STATUS_BYTES,
    RankStatus,
    encode_status,
    gather_status,
)
from metadata.pair_group import PairLink
from metadata.process_group import create_store_server
from metadata.rank_kv import RankKV, incoming_pools, outgoing_pools

# Heads 4, KV heads 2 (TINY_DEFAULTS): split at 2 ranks, each replicated on 2 ranks at 4. A
# vocabulary of 322 rows leaves 4 ranks 80.5 each: the last rank's shard is padded.
MODEL = dict(vocab_size=322, attention_bias=True, mlp_bias=True)
PROMPTS = [[5, 17, 99, 5, 40], [200, 201, 202, 7], [77] * 9 + [12, 13, 14, 15, 16, 17, 18, 19, 20]]
MAX_TOKENS = 12
# Smaller than the longest prompt: it is prefilled in chunks.
CHUNK = 8
ENGINE = dict(device="cpu", kv_cache_tokens=1024, max_num_seqs=8, chunked_prefill_size=CHUNK)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp_llama")
    make_tiny_llama(path, seed=3, **MODEL)
    return path


@pytest.fixture(scope="module")
def hf(model_path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(model_path).eval()


@pytest.fixture(scope="module")
def engines(model_path: Path):
    """One engine per rank count, shared by the module's tests."""
    built = {n: LLM(str(model_path), tensor_parallel_size=n, **ENGINE) for n in (1, 2, 4)}
    yield built
    for llm in built.values():
        llm.close()


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_greedy_matches_one_rank_and_transformers(engines, hf, ranks: int) -> None:
    expected = hf_greedy(hf, PROMPTS, MAX_TOKENS)
    assert _tokens(engines[1], GREEDY) == expected
    assert _tokens(engines[ranks], GREEDY) == expected
    # The model is not degenerate: the comparison covers more than one repeated token.
    assert all(len(set(tokens)) > 2 for tokens in expected)


@pytest.mark.parametrize("ranks", [2, 4])
def test_repetition_penalty_matches_transformers(engines, hf, ranks: int) -> None:
    params = dataclasses.replace(GREEDY, repetition_penalty=1.5)
    expected = hf_greedy(hf, PROMPTS, MAX_TOKENS, repetition_penalty=1.5)
    assert expected != hf_greedy(hf, PROMPTS, MAX_TOKENS)  # the penalty changes the output
    assert _tokens(engines[ranks], params) == expected


@pytest.mark.parametrize("ranks", [2, 4])
def test_openai_penalties_and_bias_match_one_rank(engines, ranks: int) -> None:
    params = dataclasses.replace(
        GREEDY, presence_penalty=0.7, frequency_penalty=0.4, logit_bias={5: 5.0}
    )
    expected = _tokens(engines[1], params)
    assert expected != _tokens(engines[1], GREEDY)
    assert _tokens(engines[ranks], params) == expected


@pytest.mark.skipif(not grammar_library_available(), reason="needs llguidance")
def test_grammar_matches_one_rank(engines) -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=30, temperature=0.0, grammar=json_schema_grammar(schema, "response_format")
    )
    expected = [out.text for out in engines[1].generate(PROMPTS, params)]
    for text in expected:
        assert set(json.loads(text)) == {"x"}
    assert [out.text for out in engines[2].generate(PROMPTS, params)] == expected


@pytest.mark.parametrize("ranks", [2, 4])
def test_prompt_embeddings_match_one_rank(engines, ranks: int) -> None:
    """Vectors given in place of some prompt tokens' embeddings reach every rank."""
    generator = torch.Generator().manual_seed(0)
    hidden = engines[1].model_config.hidden_size
    embeds = [{1: torch.randn(hidden, generator=generator) * 0.5}, None, {0: torch.ones(hidden)}]
    expected = _tokens_with(engines[1], embeds)
    assert expected != _tokens(engines[1], GREEDY)  # the vectors are read
    assert _tokens_with(engines[ranks], embeds) == expected


def _tokens_with(llm: LLM, embeds: list) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY, prompt_embeds=embeds)]


def test_gemma3_with_two_ranks_matches_transformers(tmp_path: Path) -> None:
    """Gemma 3's options on sharded heads: tied embeddings (the vocabulary-parallel embedding's
    rows are the LM head's), scaled embeddings, per-head q/k norms, sandwich norms,
    sliding-window layers and soft-capped logits."""
    layer_types = ["sliding_attention", "full_attention"]
    hf_model = make_tiny_family(
        tmp_path,
        "gemma3",
        seed=0,
        layer_types=layer_types,
        sliding_window=4,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
    )
    with LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE) as llm:
        assert _tokens(llm, GREEDY) == hf_greedy(hf_model, PROMPTS, MAX_TOKENS)


def test_each_rank_caches_only_its_kv_heads(engines) -> None:
    assert engines[1].engine.runner.kv_pool.num_kv_heads == 2
    assert engines[2].engine.runner.kv_pool.num_kv_heads == 1
    assert engines[4].engine.runner.kv_pool.num_kv_heads == 1


def test_layout_splits_or_replicates_kv_heads(model_path: Path) -> None:
    config = ModelConfig.from_hf(load_hf_config(model_path))
    split, replicated = TensorParallelLayout.of(config, 2), TensorParallelLayout.of(config, 4)
    assert [split.first_kv_head(r) for r in range(2)] == [0, 1]
    # Rank r's query heads (r at 4 ranks) read KV head r // 2 (2 query heads per KV head).
    assert [replicated.first_kv_head(r) for r in range(4)] == [0, 0, 1, 1]
    assert (replicated.vocab_shard, replicated.local_intermediate) == (81, 32)
    local = replicated.local_config(config)
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (1, 1, 81)


def test_shards_cover_each_weight_once(model_path: Path) -> None:
    """The ranks' slices put back together give the checkpoint's tensors (biases of the
    row-parallel projections once, on rank 0)."""
    config = ModelConfig.from_hf(load_hf_config(model_path))
    layout = TensorParallelLayout.of(config, 4)
    weight = torch.randn(config.vocab_size, config.hidden_size)
    rows = torch.cat([layout.shard_tensor("lm_head.weight", weight, r) for r in range(4)])
    assert torch.equal(rows[: config.vocab_size], weight) and not rows[config.vocab_size :].any()
    down = torch.randn(config.hidden_size, config.intermediate_size)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([layout.shard_tensor(name, down, r) for r in range(4)], 1), down)
    bias = torch.randn(config.hidden_size)
    name = "model.layers.0.self_attn.o_proj.bias"
    assert torch.equal(sum(layout.shard_tensor(name, bias, r) for r in range(4)), bias)


def test_refused_layouts_name_the_mismatch(model_path: Path) -> None:
    config = ModelConfig.from_hf(load_hf_config(model_path))
    with pytest.raises(TensorParallelError, match=r"attention heads \(num_attention_heads=4\)"):
        LLM(str(model_path), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads=3"):
        check_tensor_parallel(dataclasses.replace(config, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads=6"):
        check_tensor_parallel(dataclasses.replace(config, num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(TensorParallelError, match=r"intermediate_size=130"):
        check_tensor_parallel(dataclasses.replace(config, intermediate_size=130), 4)
    with pytest.raises(TensorParallelError, match="must be >= 1"):
        LLM(str(model_path), tensor_parallel_size=0, **ENGINE)


def test_the_default_model_refuses_two_ranks() -> None:
    """SmolLM2-135M has 9 query heads: 3 ranks split it, 2 do not (bench/tensor_parallel.py)."""
    with pytest.raises(TensorParallelError, match=r"num_attention_heads=9"):
        LLM(None, tensor_parallel_size=2, **ENGINE)


def test_refused_options_name_them() -> None:
    with pytest.raises(TensorParallelError, match="CPU"):
        check_tensor_parallel_options(2, "cuda:0")
    check_tensor_parallel_options(1, "cuda:0")  # one rank: anything goes


# Hops of a request's KV between the module's engines, each the prefill end of one and the
# decode end of the next, with the routes other than (0, 0) and their KV heads (tiny model: two).
HOPS = [
    (1, 2, {"prefill 0 -> decode 1": 1}),
    (2, 4, {"prefill 0 -> decode 1": 1, "prefill 1 -> decode 2": 1, "prefill 1 -> decode 3": 1}),
    (4, 1, {"prefill 2 -> decode 0": 1}),
]


def _hop(store_port: int, hop: int, source: LLM, target: LLM, slots: tuple) -> dict:
    """Move the target KV at `slots[0]` of `source` to `slots[1]` of `target` as a prefill
    node and a decode node do (metadata.rank_kv), the node channel's part copied here; the
    bytes landed through the links, by route."""
    room, prefill_id, decode_id = 100 + hop, 2 * hop, 2 * hop + 1
    a, b = (llm.engine.runner for llm in (source, target))
    sender = RankKV(a, True, 2, source.engine.runner.config.tensor_parallel_size, 30.0, "p")
    receiver = RankKV(b, False, 2, target.engine.runner.config.tensor_parallel_size, 30.0, "d")
    links = [
        (sender, PairLink("127.0.0.1", store_port, decode_id, 0, receiver.heads.size), prefill_id),
        (receiver, PairLink("127.0.0.1", store_port, prefill_id, 0, sender.heads.size), decode_id),
    ]
    with ThreadPoolExecutor(2) as pool:  # each side's links wait for the other's
        list(pool.map(lambda side: side[0].pair([side[1]], side[2]), links))
    incoming, landing = incoming_pools(receiver, prefill_id, room, [(b.kv_pool, slots[1])])
    landing.expect(receiver)
    outgoing, target_slots = outgoing_pools(sender, decode_id, [(a.kv_pool, slots[0])])
    assert target_slots == slots[0]
    sender.send(decode_id, room, target_slots, len(target_slots))
    (out_pool, out_slots), (in_pool, in_slots) = outgoing[0], incoming[0]
    in_pool.kv_buffer[torch.tensor(in_slots)] = out_pool.kv_buffer[torch.tensor(out_slots)]
    assert landing is not None and landing.write(receiver) is None
    for side in (sender, receiver):
        side.forget(decode_id if side is sender else prefill_id)
    return dict(receiver.landed), dict(sender.links.sent)


def test_kv_heads_cross_per_rank_between_engines_of_any_sizes(engines) -> None:
    """A request's KV from 1 rank to 2, 2 to 4 and 4 back to 1: each decode rank takes
    exactly its heads through its own link from the prefill rank the routes name (rank 0's
    first ones through the node channel), each replicated head sent once; what comes back is
    what left, and rank 0's pool of 2 ranks holds head 0 of it."""
    store, port = create_store_server("127.0.0.1")
    pools = {n: engines[n].engine.runner.kv_pool for n in (1, 2, 4)}
    n = 5
    slots = {size: pool.allocator.allocate(n) for size, pool in pools.items()}
    back = pools[1].allocator.allocate(n)
    taken = [(pool, slots[size]) for size, pool in pools.items()] + [(pools[1], back)]
    try:
        whole = torch.randn(n, pools[1].num_layers, 2, 2, pools[1].head_dim)
        pools[1].kv_buffer[torch.tensor(slots[1])] = whole
        head_bytes = whole[:, :, :, :1].numel() * whole.element_size()
        for hop, (a, b, routes) in enumerate(HOPS):
            into = back if b == 1 else list(reversed(slots[b]))  # any order, not a run
            landed, rank0_sent = _hop(port, hop, engines[a], engines[b], (slots[a], into))
            assert landed == {route: heads * head_bytes for route, heads in routes.items()}
            # Prefill rank 0 sends through its links only what it alone holds for a decode rank.
            own = {int(r.split()[-1]): h for r, h in routes.items() if r.startswith("prefill 0")}
            assert rank0_sent == {d: heads * head_bytes for d, heads in own.items()}
            slots[b] = into
        assert torch.equal(pools[1].kv_buffer[torch.tensor(back)], whole)
        assert torch.equal(pools[2].kv_buffer[torch.tensor(slots[2])], whole[:, :, :, :1])
    finally:
        for pool, held in taken:
            pool.allocator.free(held)
        del store


def _paired(
    port: int, engines: dict, sizes: tuple[int, int], ranks: tuple[int, int]
) -> tuple[RankKV, RankKV]:
    """The RankKV of a prefill engine of `sizes[0]` ranks and a decode engine of `sizes[1]`
    (two KV heads), their KV links open over the store at `port`; `ranks`: the prefill and
    decode ends' data-plane ranks."""
    (p_size, d_size), (p_rank, d_rank) = sizes, ranks
    a, b = engines[p_size].engine.runner, engines[d_size].engine.runner
    sender = RankKV(a, True, 2, p_size, 30.0, "p")
    receiver = RankKV(b, False, 2, d_size, 30.0, "d")
    links = [
        (sender, PairLink("127.0.0.1", port, d_rank, 0, d_size), p_rank),
        (receiver, PairLink("127.0.0.1", port, p_rank, 0, p_size), d_rank),
    ]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda side: side[0].pair([side[1]], side[2]), links))
    return sender, receiver


def test_kv_heads_that_do_not_land_fail_naming_the_ranks(engines) -> None:
    """A prefill end that never sends the heads of a transfer: the decode rank's wait for them
    ends at the deadline, and the landing fails naming the decode rank, the heads and the
    prefill rank."""
    store, port = create_store_server("127.0.0.1")
    b = engines[2].engine.runner
    sender, receiver = _paired(port, engines, (1, 2), (20, 21))
    receiver.timeout_s = 1.0
    slots = b.kv_pool.allocator.allocate(3)
    try:
        _, landing = incoming_pools(receiver, 20, 7, [(b.kv_pool, slots)])
        landing.expect(receiver)
        error = landing.write(receiver)
        assert error is not None
        assert error.startswith("decode rank 1: KV heads 1..1 from prefill rank 0 did not land")
        assert receiver.landed == {"prefill 0 -> decode 1": 0}
    finally:
        b.kv_pool.allocator.free(slots)
        sender.forget(21)
        receiver.forget(20)
        del store


def test_a_landing_refused_as_not_open_drops_the_ranks_receives(engines) -> None:
    """A re-pairing that failed leaves the peer's earlier links on a rank, whose receives an
    announcement still posts: refusing the landing drops them rather than leave them posted."""
    store, port = create_store_server("127.0.0.1")
    b = engines[1].engine.runner
    sender, receiver = _paired(port, engines, (2, 1), (50, 51))
    receiver.timeout_s = 1.0
    with pytest.raises(RuntimeError, match="opening the KV links"):
        receiver.pair([PairLink("127.0.0.1", port, 50, 1, 2)], 51)  # its peer never comes
    slots = b.kv_pool.allocator.allocate(3)
    try:
        _, landing = incoming_pools(receiver, 50, 9, [(b.kv_pool, slots)])
        landing.expect(receiver)
        assert any(link.receives for link in receiver.links.links[50])
        assert landing.write(receiver) == "the KV links with rank 50 are not open"
        assert not any(link.receives for link in receiver.links.links[50])
    finally:
        b.kv_pool.allocator.free(slots)
        sender.forget(51)
        receiver.forget(50)
        del store


def _open_links(port: int, key: str, timeout_s: float) -> tuple[KVLinks, KVLinks]:
    """Two ends of one link in this process, its group's timeout `timeout_s`: a prefill node of
    one rank (holding both KV heads) sends head 1 to rank 1 of a decode node of two."""
    route = KVRoute(0, 1, 1, 1)
    ends = [(LinkSpec(11, 0, route, True, key, 1), 0), (LinkSpec(10, 1, route, False, key, 0), 1)]

    def open_end(end: tuple[LinkSpec, int]) -> KVLinks:
        spec, rank = end
        links = KVLinks(KVPool(8, 2, 2 if spec.sends else 1, 16, torch.float32, "cpu"))
        plan = LinkPlan("127.0.0.1", port, timeout_s, None, (spec,))
        assert links.open(plan, rank) is None
        return links

    with ThreadPoolExecutor(2) as pool:
        sender, receiver = pool.map(open_end, ends)
    sender.pool.kv_buffer.copy_(torch.randn_like(sender.pool.kv_buffer))
    return sender, receiver


def _head_1(links: KVLinks, slots: list[int]) -> torch.Tensor:
    return links.pool.kv_buffer[torch.tensor(slots)][:, :, :, 1:2]


def test_an_unmatched_send_holds_up_no_other_and_ends_at_the_timeout() -> None:
    """A send that the decode end never receives stays in flight; later transfers on the same
    link still land and let go of their buffers as they end, and the unmatched one ends at the
    link's timeout (10 s here), which breaks the link."""
    store, port = create_store_server("127.0.0.1")
    sender, receiver = _open_links(port, "unmatched/", 10.0)
    sender.send(11, 1, slot_index([1, 2]), 2)  # room 1: never received
    for room in (2, 3):
        receiver.expect(10, room, 2)
        sender.send(11, room, slot_index([room, room + 2]), 2)
        assert receiver.land(10, room, slot_index([room, room + 2]), 30.0) is None
    landed = receiver.pool.kv_buffer[torch.tensor([2, 3, 4, 5])]
    assert torch.equal(landed, _head_1(sender, [2, 3, 4, 5]))
    assert wait_for(lambda: sender.in_flight(11) == 1)  # room 1's send alone
    assert wait_for(lambda: sender.in_flight(11) == 0, 60.0)
    [link] = sender.links[11]
    assert link.broken is not None
    sender.forget(11)
    receiver.forget(10)
    del store


def test_a_room_announced_twice_keeps_its_first_receive_held() -> None:
    """The first receive of a room announced again is held with its buffer, not replaced
    while posted: the room's two sends land in order, the second at the landing."""
    store, port = create_store_server("127.0.0.1")
    sender, receiver = _open_links(port, "twice/", 30.0)
    receiver.expect(10, 7, 2)
    receiver.expect(10, 7, 2)
    assert receiver.in_flight(10) == 2
    sender.send(11, 7, slot_index([1, 2]), 2)
    sender.send(11, 7, slot_index([5, 6]), 2)
    assert receiver.land(10, 7, slot_index([3, 4]), 30.0) is None
    assert torch.equal(receiver.pool.kv_buffer[torch.tensor([3, 4])], _head_1(sender, [5, 6]))
    assert wait_for(lambda: receiver.in_flight(10) == 0 and sender.in_flight(11) == 0)
    sender.forget(11)
    receiver.forget(10)
    del store


def test_heads_past_their_deadline_fail_without_the_groups_whole_timeout() -> None:
    """A landing whose deadline has passed (no time left) waits a moment only: a timeout of zero
    means none of the wait's own to gloo, which waits the link group's instead (the whole
    transfer timeout, here 10 minutes) for heads that never come."""
    store, port = create_store_server("127.0.0.1")
    _, receiver = _open_links(port, "deadline/", 600.0)
    receiver.expect(10, 4, 3)
    result: list[str | None] = []
    waiting = threading.Thread(
        target=lambda: result.append(receiver.land(10, 4, slot_index([1, 2, 3]), 0.0)),
        daemon=True,
    )
    waiting.start()
    waiting.join(60.0)  # bounds a wait that would never end; no timing is checked
    assert result and result[0].startswith("KV heads 1..1 from prefill rank 0 did not land")
    del store


def test_a_failed_pairing_names_the_node_its_side_and_the_peer(engines) -> None:
    """A peer that never makes its end of the links: the pairing fails after the timeout,
    naming this node, which end it is, the peer node and the rank."""
    store, port = create_store_server("127.0.0.1")
    sender = RankKV(engines[1].engine.runner, True, 2, 1, 1.0, "prefill-0")
    try:
        with pytest.raises(RuntimeError) as err:
            sender.pair([PairLink("127.0.0.1", port, 41, 0, 2, "decode-3")], 40)
        assert str(err.value).startswith(
            "prefill-0 (prefill end): opening the KV links with decode-3 failed: "
            "rank 0: opening its KV links failed: "
        )
    finally:
        sender.forget(41)
        del store


def test_a_ranks_failed_landing_fails_that_transfer_and_the_ranks_serve_on(
    engines, monkeypatch
) -> None:
    """A landing that fails on one rank (a follower: slots outside its pool; rank 0: an
    injected error) ends that transfer with an error naming the rank, and every rank still
    reaches the status gather: the next transfer lands whole and the engine serves on."""
    store, port = create_store_server("127.0.0.1")
    a, b = engines[1].engine.runner, engines[2].engine.runner
    sender, receiver = _paired(port, engines, (1, 2), (30, 31))
    n = 3
    source, slots = a.kv_pool.allocator.allocate(n), b.kv_pool.allocator.allocate(n)

    def transfer(room: int, into: list[int]) -> str | None:
        _, landing = incoming_pools(receiver, 30, room, [(b.kv_pool, into)])
        landing.expect(receiver)
        sender.send(31, room, source, n)
        return landing.write(receiver)

    def injected(*args, **kwargs):
        raise RuntimeError("injected")

    try:
        outside = [b.kv_pool.kv_buffer.shape[0] + 7] * n
        error = transfer(1, outside)
        assert error is not None and error.startswith("decode rank 1: ")
        assert "decode rank 0" not in error
        with monkeypatch.context() as patch:
            patch.setattr(receiver.links, "land", injected)
            assert transfer(2, slots) == "decode rank 0: RuntimeError: injected"
        assert transfer(3, slots) is None
        head_bytes = n * b.kv_pool.num_layers * 2 * b.kv_pool.head_dim * 4
        assert receiver.landed["prefill 0 -> decode 1"] == 2 * head_bytes
        assert _tokens(engines[2], GREEDY) == _tokens(engines[1], GREEDY)
    finally:
        a.kv_pool.allocator.free(source)
        b.kv_pool.allocator.free(slots)
        sender.forget(31)
        receiver.forget(30)
        del store


def test_a_status_fits_its_buffer_whatever_its_error_escapes_to() -> None:
    """Control characters take six bytes each in JSON: an error of them is cut until the
    status fits, and still reads as the start of the rank's error."""
    group = RankGroup.join(dist.HashStore(), 0, 1)
    error = "\x01" * 1000
    assert len(json.dumps(error)) > STATUS_BYTES
    [status] = gather_status(group, RankStatus(error, {1: 5}))
    assert status.error and error.startswith(status.error)
    assert len(encode_status(RankStatus(error))) <= STATUS_BYTES


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, whose parent has not reaped it, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], deadline_s: float = 60.0) -> list[int]:
    """The pids still running after they had `deadline_s` to exit."""
    end = time.monotonic() + deadline_s
    while any(_running(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def _follower_pids(llm: LLM) -> list[int]:
    return [process.pid for process in llm.engine.runner.followers.processes]


def test_close_ends_the_ranks(model_path: Path) -> None:
    llm = LLM(str(model_path), tensor_parallel_size=2, **ENGINE)
    pids = _follower_pids(llm)
    assert all(_running(pid) for pid in pids)
    llm.close()
    assert _wait_gone(pids) == []
    with pytest.raises(PdclusterError, match="closed"):
        llm.generate(PROMPTS, GREEDY)
    llm.close()  # idempotent


def test_collection_ends_the_ranks(model_path: Path) -> None:
    llm = LLM(str(model_path), tensor_parallel_size=2, **ENGINE)
    pids = _follower_pids(llm)
    del llm
    gc.collect()
    assert _wait_gone(pids) == []


def test_a_dead_rank_fails_requests_naming_it(model_path: Path) -> None:
    llm = LLM(str(model_path), tensor_parallel_size=2, **ENGINE)
    [pid] = _follower_pids(llm)
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone([pid]) == []
    with pytest.raises(PdclusterError, match="tensor parallel rank 1 exited"):
        llm.generate(PROMPTS, GREEDY)
    llm.close()


def test_ranks_end_when_rank_zero_dies(model_path: Path, tmp_path: Path) -> None:
    """A process holding a tensor parallel LLM is killed outright: its followers leave too."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from engine import LLM
        if __name__ == "__main__":
            llm = LLM({str(model_path)!r}, tensor_parallel_size=2, **{ENGINE!r})
            llm.generate([[5, 6, 7]])
            pids = [p.pid for p in llm.engine.runner.followers.processes]
            print(" ".join(map(str, pids)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    (tmp_path / "rank_zero.py").write_text(script)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "rank_zero.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == -9, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 1
    assert _wait_gone(pids) == []
