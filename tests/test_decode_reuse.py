"""A conversation's next turn on the decode node that holds it (decode_node.reuse), through
clusters of Ray local actors on CPU: the second turn's transfer carries only the KV of the
positions the decode node does not hold (its counters of transferred and reused tokens say
so), the output is the offline engine's without a cache, a decode node that evicted the first
turn in between gets the full transfer with the same output, and every pool is empty but for
the cache afterwards, with a clean KV audit. With two decode nodes and --decode-policy
cache_aware the second turn goes back to the node that served the first; a speculating pair
sends the draft depths' KV of the new positions only, losslessly; with --disable-decode-reuse
every transfer carries the whole prompt."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch
from cluster_helpers import launch, serve, wait_for
from node_builders import built, new_decode_node
from stream_recorder import FRONTEND
from test_decode_samples import PREFILL_RANK, Recorder
from test_early_announce import finish_sends
from test_prefix_cache_nodes import KVRecorder, _real_prefill_node
from tiny_drafts import make_good_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from metadata.messages import (
    AbortRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TransferAbandoned,
    TransferAnnounce,
)
from metadata.transfer import TransferState

ray = pytest.importorskip("ray")

POOL = 512
ENGINE = dict(max_model_len=POOL, kv_cache_tokens=POOL, max_num_seqs=8)
MAX_TOKENS = 6
SPEC_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-decode-reuse")
    make_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model, device="cpu", enable_prefix_cache=False, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return lambda prompt: llm.generate([prompt], params)[0].token_ids


def _prefill_request(room: int, prompt: list[int], reused: int) -> PrefillRequest:
    sampling = SamplingSpec(4, 0.0, 0, 1.0, None, [], [], True, None)
    return PrefillRequest(room, str(room), prompt, sampling, 0, 1, reused_tokens=reused)


def test_a_prefill_node_sends_only_the_positions_the_decode_node_lacks(tiny_model_path):
    """Asked to leave out the 25 positions the decode node holds, the prefill node still
    computes the whole prompt, announces the count back and sends the KV of the rest: the
    same as the last positions of a full transfer."""
    prompt = list(range(30, 70))
    sent = {}
    for reused in (0, 25):
        recorder = KVRecorder()
        with _real_prefill_node(tiny_model_path, recorder, cache=False) as node:
            node._handle(_prefill_request(7, prompt, reused))
            node._feed()
            while node.prefilling:
                node.engine.step()
            finish_sends(node, recorder)
            (announce,) = recorder.messages(TransferAnnounce)
            assert (announce.num_tokens, announce.reused_tokens) == (len(prompt), reused)
            totals = node.outgoing.totals
            assert (totals.kv_tokens, totals.reused_tokens) == (len(prompt) - reused, reused)
            assert node.kv_cache.is_empty()
        [sent[reused]] = recorder.kv[7]
    assert sent[25].shape[0] == len(prompt) - 25
    torch.testing.assert_close(sent[25], sent[0][25:])


def test_a_prefill_node_refuses_to_leave_out_the_whole_prompt(tiny_model_path):
    recorder = KVRecorder()
    with _real_prefill_node(tiny_model_path, recorder, cache=False) as node:
        node._handle(_prefill_request(8, [5, 6, 7], reused=3))
        (abandoned,) = recorder.messages(TransferAbandoned)
        assert "3 reused tokens of a 3-token prompt" in abandoned.reason
        assert not node.waiting and node.kv_cache.is_empty()


def test_a_decode_node_holds_a_conversations_prefix_until_the_request_lets_go(tiny_model_path):
    """Node level (no Ray): a finished request's prompt and answer stay in the decode node's
    cache; the next turn asks the prefill node for the rest only, lands it after the held
    positions, and lets go of its hold whether its prefill node dies or it is aborted."""
    with built(new_decode_node(tiny_model_path, 64, 4, max_num_seqs=8)) as decode:
        recorder = Recorder().attach(decode)
        sampling = SamplingSpec(3, 0.0, 0, 1.0, None, [], [], True, None)

        def ask(room: int, prompt: list[int]) -> PrefillRequest:
            decode._handle(GenerateRequest(room, str(room), prompt, sampling, 0, FRONTEND))
            decode._preallocate()
            return recorder.of(PrefillRequest)[-1]

        def announce(room: int, prompt: list[int], reused: int) -> None:
            decode._handle(TransferAnnounce(room, PREFILL_RANK, len(prompt), reused_tokens=reused))

        first = list(range(3, 13))
        assert ask(1, first).reused_tokens == 0
        announce(1, first, 0)
        decode.metadata.output_ids[decode.rooms[1].meta_row] = 40
        decode._handle(PrefillResult(1))
        recorder.receives[1][1].advance(TransferState.SUCCESS)
        decode._land_transfers()
        while decode.engine.has_work():
            decode._step()
        assert not decode.rooms and decode.kv_cache.is_empty()
        answer = list(decode.kv_cache.prefix_cache.root.children[3].key[len(first) :])
        assert len(answer) == 2  # the third token's KV was never computed

        second = first + answer + [77, 78]
        held = len(first) + len(answer)
        assert ask(2, second).reused_tokens == held
        announce(2, second, held)
        assert recorder.receives[2][0] == [len(second) - held]  # lands after the held ones
        decode._drop_peer(0, PREFILL_RANK, "prefill-0 died")
        assert not decode.rooms and decode.kv_cache.is_empty()
        assert all(p.used == p.held for p in decode._pool_counts())

        assert ask(3, second).reused_tokens == held  # still held, and held again
        decode._handle(AbortRequest(3))
        assert recorder.of(AbortRequest)[-1].room == 3  # told to the prefill node, which
        decode._handle(TransferAbandoned(3, "prefill-0: aborted before prefill"))
        assert decode.kv_cache.is_empty() and decode.metadata.num_free == 4
        assert all(p.used == p.held for p in decode._pool_counts())


def _tokens(rng: random.Random, n: int, first: int | None = None) -> list[int]:
    tokens = [rng.randrange(3, 300) for _ in range(n)]
    if first is not None:
        tokens[0] = first  # no two conversations share a prefix
    return tokens


def _complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _transfers(cluster) -> dict[str, dict]:
    """Each decode node's receive totals, by node name."""
    return {s["node"]: s["transfers"] for s in cluster.node_stats() if s["node"].startswith("d")}


def _sent_and_reused(cluster, node: str, before: dict[str, dict]) -> tuple[int, int]:
    now = _transfers(cluster)[node]
    then = before.get(node, {"kv_tokens": 0, "reused_tokens": 0})
    return now["kv_tokens"] - then["kv_tokens"], now["reused_tokens"] - then["reused_tokens"]


def _assert_pools_clean(cluster) -> None:
    assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
    for actor in cluster.prefill_actors + cluster.decode_actors:
        assert ray.get(actor.audit_kv.remote()) == []


@pytest.fixture(scope="module")
def pair(tiny_model):
    cluster = launch(tiny_model, prefill=1, decode=1, **ENGINE)
    server = serve(cluster)
    yield cluster, server.url
    server.stop()
    cluster.shutdown()


def test_the_second_turn_takes_only_the_new_tokens_kv(pair, offline):
    """Turn 1 is a full transfer; turn 2 (turn 1's prompt, its answer and a new message) takes
    only the positions past what the decode node holds: all of turn 1 but the answer's last
    token, whose KV no step computed."""
    cluster, url = pair
    rng = random.Random(1)
    first = _tokens(rng, 40, first=301)
    before = _transfers(cluster)
    answer = _complete(url, first)
    assert answer == offline(first)
    assert _sent_and_reused(cluster, "decode-0", before) == (len(first), 0)

    second = first + answer + _tokens(rng, 7)
    before = _transfers(cluster)
    answer2 = _complete(url, second)
    assert answer2 == offline(second)
    held = len(first) + len(answer) - 1
    assert _sent_and_reused(cluster, "decode-0", before) == (len(second) - held, held)
    _assert_pools_clean(cluster)
    stats = {s["node"]: s for s in cluster.node_stats()}
    assert stats["decode-0"]["prefix_cache_tokens"] >= len(second)
    sent = stats["prefill-0"]["transfers"]
    received = stats["decode-0"]["transfers"]
    assert (sent["kv_tokens"], sent["reused_tokens"]) == (
        received["kv_tokens"],
        received["reused_tokens"],
    )


def test_a_decode_node_that_evicted_the_turn_gets_the_full_transfer(pair, offline):
    """A prompt that needs nearly the whole pool evicts what the decode node held of a
    conversation: its next turn then comes whole, with the same output as the offline
    engine's (and as the one that reused)."""
    cluster, url = pair
    rng = random.Random(2)
    first = _tokens(rng, 30, first=302)
    answer = _complete(url, first)
    second = first + answer + _tokens(rng, 5)

    filler = _tokens(rng, POOL - 40, first=303)
    before = _transfers(cluster)
    assert _complete(url, filler) == offline(filler)
    assert _sent_and_reused(cluster, "decode-0", before) == (len(filler), 0)

    before = _transfers(cluster)
    assert _complete(url, second) == offline(second)
    assert _sent_and_reused(cluster, "decode-0", before) == (len(second), 0)
    # Now it holds the second turn: the same prompt again reuses all of it but the last token.
    before = _transfers(cluster)
    assert _complete(url, second) == offline(second)
    assert _sent_and_reused(cluster, "decode-0", before) == (1, len(second) - 1)
    stats = {s["node"]: s for s in cluster.node_stats()}
    assert stats["decode-0"]["prefix_cache_evicted_tokens"] > 0
    _assert_pools_clean(cluster)


def test_two_decode_nodes_each_keep_their_conversations(tiny_model, offline):
    """--decode-policy cache_aware: two conversations, one per decode node; each second turn
    goes back to the node that served its first and reuses what it holds there."""
    cluster = launch(tiny_model, prefill=1, decode=2, decode_policy="cache_aware", **ENGINE)
    server = serve(cluster)
    try:
        rng = random.Random(3)
        firsts = [_tokens(rng, 40, first=304), _tokens(rng, 40, first=305)]
        answers = [_complete(server.url, prompt) for prompt in firsts]
        served = _transfers(cluster)
        assert [served[f"decode-{i}"]["count"] for i in range(2)] == [1, 1], served
        seconds = [p + a + _tokens(rng, 6) for p, a in zip(firsts, answers)]
        for i, second in enumerate(seconds):
            before = _transfers(cluster)
            assert _complete(server.url, second) == offline(second)
            held = len(firsts[i]) + len(answers[i]) - 1
            assert _sent_and_reused(cluster, f"decode-{i}", before) == (len(second) - held, held)
        _assert_pools_clean(cluster)
    finally:
        server.stop()
        cluster.shutdown()


def _speculating_conversation(cluster, url: str, llm: LLM) -> tuple[list[int], list[int]]:
    """Three turns of one conversation, then a prompt that fills the pool, each answer checked
    against `llm`'s; returns each turn's reused positions and the decode node's accepted drafts
    per position."""
    params = SamplingParams(max_tokens=SPEC_MAX_TOKENS, temperature=0, ignore_eos=True)
    rng = random.Random(4)
    prompt = _tokens(rng, 40, first=306)
    reuses = []
    for _ in range(3):
        before = _transfers(cluster)
        answer = _complete(url, prompt, SPEC_MAX_TOKENS)
        assert answer == llm.generate([prompt], params)[0].token_ids
        sent, reused = _sent_and_reused(cluster, "decode-0", before)
        assert sent + reused == len(prompt)
        reuses.append(reused)
        prompt = prompt + answer + _tokens(rng, 5)
    # A prompt that needs nearly the whole pool: the cache gives way, the draft depths' KV with
    # the target's, before the request can preallocate.
    filler = _tokens(rng, POOL - 40, first=309)
    assert _complete(url, filler, SPEC_MAX_TOKENS) == llm.generate([filler], params)[0].token_ids
    stats = next(s for s in cluster.node_stats() if s["node"] == "decode-0")
    assert stats["spec_verify_steps"] > 0
    _assert_pools_clean(cluster)
    return reuses, stats["spec_accepted_per_position"]


def test_a_speculating_pair_sends_only_the_new_positions_draft_kv(tiny_model, tmp_path):
    """A speculating decode node's cache holds its draft depths' KV with the target's; a match
    of L tokens gives both for L - K positions (spec/runtime/prefix_drafts.py), and the transfer
    brings the target's and every depth's KV from there on. The output is the offline
    engine's without speculation nor cache, and the drafts accept exactly as many tokens at
    each position as with full transfers: the depths read the same KV."""
    depths = 2
    draft = make_good_draft(tmp_path / "draft", Path(tiny_model), depths, noise=0.01)
    speculation = dict(
        speculative_algorithm="multi-layer-eagle", draft_model=str(draft), num_draft_steps=depths
    )
    llm = LLM(tiny_model, device="cpu", enable_prefix_cache=False, **ENGINE)
    outcomes = {}
    for reuse in (True, False):
        dump = str(tmp_path / f"dump-{reuse}")
        cluster = launch(
            tiny_model,
            prefill=1,
            decode=1,
            decode_reuse=reuse,
            debug_tensor_dump_dir=dump,
            **speculation,
            **ENGINE,
        )
        server = serve(cluster)
        try:
            outcomes[reuse] = _speculating_conversation(cluster, server.url, llm)
        finally:
            server.stop()
            cluster.shutdown()
    (reused, accepted), (no_reuse, accepted_whole) = outcomes[True], outcomes[False]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused
    assert no_reuse == [0, 0, 0]
    assert accepted == accepted_whole and sum(accepted) > 0
    # Every draft forward of the decode node read the same KV: the same outputs.
    for depth in range(depths):
        reusing = _forwards(tmp_path / "dump-True", depth)
        whole = _forwards(tmp_path / "dump-False", depth)
        assert len(reusing) == len(whole) > 0
        for mine, theirs in zip(reusing, whole, strict=True):
            assert mine.keys() == theirs.keys()
            for name in mine:
                torch.testing.assert_close(mine[name], theirs[name], atol=1e-5, rtol=1e-5)


def _forwards(dump: Path, depth: int) -> list[dict[str, torch.Tensor]]:
    """The decode node's draft depth `depth` forwards' module outputs, in order."""
    folder = dump / "decode-0" / f"draft-{depth}" / "rank0"
    files = sorted(folder.glob("forward_*.pt"))
    return [torch.load(f, weights_only=True)["outputs"] for f in files]


def test_disable_decode_reuse_sends_every_prompt_whole(tiny_model, offline):
    cluster = launch(tiny_model, prefill=1, decode=1, decode_reuse=False, **ENGINE)
    server = serve(cluster)
    try:
        rng = random.Random(5)
        first = _tokens(rng, 30, first=307)
        answer = _complete(server.url, first)
        second = first + answer + _tokens(rng, 5)
        assert _complete(server.url, second) == offline(second)
        received = _transfers(cluster)["decode-0"]
        assert (received["kv_tokens"], received["reused_tokens"]) == (
            len(first) + len(second),
            0,
        )
        decode = next(s for s in cluster.node_stats() if s["node"] == "decode-0")
        assert "prefix_cache_tokens" not in decode
    finally:
        server.stop()
        cluster.shutdown()
