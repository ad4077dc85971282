"""Chunked prefill: a prompt longer than `chunked_prefill_size` is prefilled over several steps.
Output is unchanged (plain, speculative, with vectors given for prompt positions, through the
disaggregated cluster); running requests decode between the chunks; a short request behind a
long prompt is served in the long prompt's first step; an abort between chunks frees the
prompt's slots before the next one, on the offline engine and on a prefill node."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from test_early_announce import PROMPTS, Recorder, finish_sends, recorded_prefill_node
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.request import Request
from metadata.messages import AbortRequest, TransferAbandoned, TransferAnnounce
from prefill_node.node import PrefillNode
from prefill_node.pending import Pending

SPEC = "multi-layer-eagle"
K = 3
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, torch.Tensor]:
    """(a tiny random Llama, a predictable Llama, a good draft for the latter, the latter's
    embedding table)."""
    root = tmp_path_factory.mktemp("chunked_prefill")
    make_tiny_llama(root / "tiny", seed=0)
    hf = make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", K, noise=0.01)
    table = hf.model.embed_tokens.weight.detach().clone()
    return root / "tiny", root / "target", root / "draft", table


def _llm(model: Path, chunk: int, draft: Path | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    if draft is not None:
        kw.update(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_steps=K)
    return LLM(str(model), device="cpu", chunked_prefill_size=chunk, **kw)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(1, 70))] for _ in range(n)]


def _clean(llm: LLM) -> bool:
    engine = llm.engine
    return (
        not engine.has_work()
        and engine.kv_cache.is_empty()
        and (engine.speculator is None or engine.speculator.is_empty())
    )


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_chunked_output_equals_whole_prompt_output(models, chunk: int):
    tiny, *_ = models
    prompts = _prompts(12, seed=chunk)
    expected = [o.token_ids for o in _llm(tiny, 0).generate(prompts, GREEDY)]
    llm = _llm(tiny, chunk)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert _clean(llm)


def test_speculation_after_a_chunked_prefill_is_lossless_and_drafts_the_same(models):
    """The draft's prefill reads the whole prompt's hidden states, joined from the chunks: its
    first chains, hence every verify step's accepts, are those of the unchunked prefill."""
    _, target, draft, _ = models
    prompts = _prompts(10, seed=3)
    expected = [o.token_ids for o in _llm(target, 0).generate(prompts, GREEDY)]
    whole = _llm(target, 0, draft).generate(prompts, GREEDY)
    llm = _llm(target, 6, draft)
    chunked = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in chunked] == expected
    assert [o.usage.spec_accepted_per_position for o in chunked] == [
        o.usage.spec_accepted_per_position for o in whole
    ]
    assert _clean(llm)


def test_vectors_given_for_prompt_positions_reach_every_chunk_and_the_draft(models):
    _, target, draft, table = models
    prompts = [list(range(10, 40)), [5, 250, 251, 252, 253, 7, 8, 9]]
    rng = torch.Generator().manual_seed(0)
    embeds = [
        {2: table[200].clone(), 11: torch.randn(64, generator=rng), 29: table[77].clone()},
        {0: torch.randn(64, generator=rng), 7: table[31].clone()},
    ]
    whole = _llm(target, 0, draft).generate(prompts, GREEDY, prompt_embeds=embeds)
    chunked = _llm(target, 5, draft).generate(prompts, GREEDY, prompt_embeds=embeds)
    plain = _llm(target, 0).generate(prompts, GREEDY, prompt_embeds=embeds)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in plain]
    assert [o.usage.spec_accepted_per_position for o in chunked] == [
        o.usage.spec_accepted_per_position for o in whole
    ]


def _request(engine, name: str, length: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = engine.make_request(name, [3 + i % 300 for i in range(length)], params)
    engine.add_request(req)
    return req


def test_running_requests_decode_between_chunks_and_short_ones_join_the_first(models):
    """Without mixed steps (tests/test_mixed_steps.py has them: every step decodes)."""
    tiny, *_ = models
    # Every prompt here begins alike: without the prefix cache, each is computed whole.
    engine = _llm(tiny, 16, mixed_prefill=False, enable_prefix_cache=False).engine
    running = _request(engine, "running", 5, max_tokens=20)
    engine.step()
    assert len(running.output_token_ids) == 1
    long = _request(engine, "long", 60)
    short = _request(engine, "short", 4)
    kinds = []
    while not long.output_token_ids:
        batch_ids = {id(r) for r in engine.scheduler.running}
        before = len(running.output_token_ids)
        engine.step()
        kinds.append("decode" if len(running.output_token_ids) > before else "prefill")
        if len(kinds) == 1:
            # The first chunk's step also prefilled the short request whole.
            assert short.output_token_ids and id(short) not in batch_ids
            assert long.kv_len == 16
    # Four chunks of 16, 16, 16 and 12 tokens, a decode step after each but the last.
    assert kinds == ["prefill", "decode", "prefill", "decode", "prefill", "decode", "prefill"]
    while engine.has_work():
        engine.step()
    assert engine.kv_cache.is_empty()


def test_an_abort_between_chunks_frees_the_prompt_before_the_next_chunk(models):
    tiny, *_ = models
    llm = _llm(tiny, 16)
    engine = llm.engine
    long = _request(engine, "long", 60)
    engine.step()
    assert long.kv_len == 16 and engine.kv_cache.kv_pool.allocator.num_used == 16
    assert engine.scheduler.abort("long") is long
    assert engine.kv_cache.is_empty() and long.finish_reason == "abort"
    short = _request(engine, "short", 4)
    engine.step()
    assert short.output_token_ids and not engine.scheduler.waiting
    while engine.has_work():
        engine.step()
    assert _clean(llm)


# --- on a prefill node (tests/test_early_announce.py's, over the tiny model, and its recorder) ---


@pytest.fixture
def prefill_node(tiny_model_path: Path) -> Iterator[Callable[..., PrefillNode]]:
    with ExitStack() as nodes:

        def make(recorder: Recorder, chunk: int) -> PrefillNode:
            return recorded_prefill_node(
                nodes, tiny_model_path, recorder, chunked_prefill_size=chunk
            )

        yield make


def _queue(node, room: int, prompt: list[int]) -> None:
    req = Request(str(room), prompt, SamplingParams(max_tokens=4, temperature=0))
    node.waiting.append([Pending(req, decode_node=0, decode_rank=1)])


def test_a_prefill_node_announces_before_the_last_chunk_and_sends_after_it(prefill_node):
    """Announced and sent in one step, a transfer keeps the order of announcements to a decode
    node the order of its sends (NCCL matches by order), whatever runs between the chunks."""
    recorder = Recorder()
    node = prefill_node(recorder, chunk=3)
    _queue(node, 31, list(range(3, 11)))
    node._feed()
    for _ in range(3):
        node.engine.step()
    # Alone for its decode node, its KV is posted once the last chunk's forward is enqueued.
    assert recorder.kinds() == ["forward"] * 2 + ["TransferAnnounce", "forward"] + [
        "kv-begin",
        "PrefillResult",
        "kv",
    ]
    assert recorder.messages(TransferAnnounce)[0].num_tokens == 8
    assert ("kv-begin", 31, [8]) in recorder.events
    assert [e[1:] for e in recorder.events if e[0] == "kv"] == [(31, [8], 31)]
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


def test_an_abort_between_a_prefill_nodes_chunks_frees_the_slots_and_abandons_it(prefill_node):
    recorder = Recorder()
    node = prefill_node(recorder, chunk=3)
    _queue(node, 41, list(range(3, 11)))
    _queue(node, 42, [5, 6])
    node._feed()
    node.engine.step()  # room 41's first chunk, room 42 whole
    assert node.kv_cache.num_used_slots == 3 + 2
    node._handle(AbortRequest(41))
    # Room 41's slots are free at once (its first chunk's KV stays cached, free to evict);
    # it was never announced, so nothing is sent for it.
    assert node.kv_cache.num_used_slots == 2
    assert [a.room for a in recorder.messages(TransferAnnounce)] == [42]
    assert [e[1:] for e in recorder.events if e[0] == "kv"] == [(42, [2], 42)]
    abandoned = recorder.messages(TransferAbandoned)
    assert [(a.room, a.reason) for a in abandoned] == [(41, "prefill-0: aborted before prefill")]
    assert not node.engine.has_work() and not node.prefilling
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


def test_whole_prompts_on_a_prefill_node_are_unchanged_by_the_chunk_size(prefill_node):
    """Prompts shorter than the chunk size go as they always went: one forward, every transfer
    announced before it."""
    recorder = Recorder()
    node = prefill_node(recorder, chunk=64)
    node.waiting = deque()
    for room, (prompt, _) in PROMPTS.items():
        _queue(node, room, prompt)
    node._feed()
    node.engine.step()
    assert recorder.kinds() == ["TransferAnnounce"] * 3 + ["forward"] + ["PrefillResult", "kv"] * 3


# --- through the disaggregated cluster ---


def test_the_cluster_with_chunked_prefill_gives_the_offline_engines_output(models):
    ray = pytest.importorskip("ray")
    del ray
    from cluster_helpers import launch, wait_for

    _, target, draft, _ = models
    prompts = _prompts(8, seed=5)
    expected = [o.token_ids for o in _llm(target, 0).generate(prompts, GREEDY)]
    engine = dict(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=16)
    cluster = launch(
        str(target),
        prefill=1,
        decode=1,
        chunked_prefill_size=8,
        speculative_algorithm=SPEC,
        draft_model=str(draft),
        num_draft_steps=K,
        **engine,
    )
    try:

        async def main():
            router = cluster.router
            try:
                return await asyncio.gather(
                    *(_collect(router, f"r{i}", p) for i, p in enumerate(prompts))
                )
            finally:
                await router.close()

        assert asyncio.run(main()) == expected
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()


async def _collect(router, name: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for delta in router.generate(name, prompt, GREEDY):
        tokens += delta.token_ids
    return tokens


@pytest.mark.gpu
def test_chunked_prefill_on_a_gpu_gives_the_whole_prompts_output(models):
    """The Triton backend's extend after a cached prefix, with the decode steps in CUDA graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tiny, *_ = models
    prompts = _prompts(12, seed=11)

    def run(chunk: int) -> list[list[int]]:
        llm = LLM(str(tiny), device="cuda", dtype="float32", chunked_prefill_size=chunk)
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]

    assert run(7) == run(0)
