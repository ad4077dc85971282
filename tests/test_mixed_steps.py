"""Mixed steps (engine.scheduling.scheduler, `mixed_prefill`): a step that admits prompts while
requests run is one forward of both, the running requests decoding their next token beside the
prompts (or a prompt's chunk). The output is the output without mixing, token for token, for every
kind of request (greedy, seeded sampling, chunks, parallel samples, processors, logprobs, grammars,
vectors for prompt positions, stop strings, retraction, aborts, overlap); the decode tokens count in
the step's token budget; admission keeps the next step's slots free; speculating engines and the
switch leave the steps apart; traces stamp both kinds of span."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.torch_metadata import PerRequestMetadata, prepare_per_request
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kernels import triton_runs_on
from engine.loading.loader import EngineArgs, resolve
from engine.request import Request
from engine.sampling.grammar import json_schema_grammar
from engine.scheduling.scheduler import ScheduledBatch
from engine.scheduling.step_setup import mixed_step_tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _llm(path: Path, mixed: bool, chunked_prefill_size: int = 0, **kw) -> LLM:
    """Prompts in one step unless `chunked_prefill_size` is given."""
    kw = {"kv_cache_tokens": 4096, "max_num_seqs": 4, **kw}
    chunks = chunked_prefill_size
    return LLM(str(path), device="cpu", mixed_prefill=mixed, chunked_prefill_size=chunks, **kw)


def _recorded(llm: LLM) -> list[ScheduledBatch]:
    """Every batch the engine's scheduler hands out from now on."""
    batches: list[ScheduledBatch] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            batches.append(batch)
        return batch

    scheduler.schedule = recording
    return batches


def _mixed_steps(batches: list[ScheduledBatch]) -> int:
    return sum(1 for batch in batches if batch.decoding)


def _prompts(n: int, seed: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def _summary(outputs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def _both(path: Path, prompts, params, generate=None, **kw) -> tuple[list, list, LLM]:
    """The outputs without mixing and with it, and the mixing engine (which ran mixed steps
    and gave every slot back)."""
    generate = generate or {}
    unmixed = _llm(path, False, **kw)
    assert not unmixed.engine.scheduler.mixed
    plain_batches = _recorded(unmixed)
    expected = unmixed.generate(prompts, params, **generate)
    assert _mixed_steps(plain_batches) == 0
    mixed = _llm(path, True, **kw)
    batches = _recorded(mixed)
    got = mixed.generate(prompts, params, **generate)
    assert _mixed_steps(batches) > 0
    assert mixed.engine.kv_cache.is_empty() and not mixed.engine.has_work()
    return expected, got, mixed


# --- one forward ---------------------------------------------------------------------------


def _request(
    engine: EngineCore, name: str, length: int, max_tokens: int = 8, prompt: list[int] | None = None
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompt = prompt or [3 + (7 * i + len(name)) % 300 for i in range(length)]
    req = engine.make_request(name, prompt, params)
    engine.add_request(req)
    return req


def _count_forwards(engine: EngineCore) -> list[list[int]]:
    """The spans (new tokens per request) of every forward the engine's runner runs."""
    spans: list[list[int]] = []
    forward = engine.runner.forward

    def counting(batch, **kw):
        spans.append(list(batch.extend_lens))
        return forward(batch, **kw)

    engine.runner.forward = counting
    return spans


@pytest.mark.parametrize("mixed", [True, False])
def test_admitting_a_prompt_while_others_run_is_one_forward(tiny_model_path: Path, mixed: bool):
    engine = _llm(tiny_model_path, mixed).engine
    running = [_request(engine, f"r{i}", 5 + i, max_tokens=20) for i in range(2)]
    engine.step()
    spans = _count_forwards(engine)
    prompt = _request(engine, "new", 9)
    before = [len(req.output_token_ids) for req in running]
    engine.step()
    assert prompt.output_token_ids and prompt in engine.scheduler.running
    decoded = [len(req.output_token_ids) - n for req, n in zip(running, before)]
    if mixed:
        # The running requests' next tokens (a span of one each) and the prompt, one forward.
        assert spans == [[1, 1, 9]] and decoded == [1, 1]
    else:
        # The prompt's step of its own: the running requests waited.
        assert spans == [[9]] and decoded == [0, 0]
    while engine.has_work():
        engine.step()
    assert engine.kv_cache.is_empty()


def test_every_chunk_of_a_long_prompt_rides_in_a_decode_step(tiny_model_path: Path):
    engine = _llm(tiny_model_path, True, chunked_prefill_size=16).engine
    running = _request(engine, "running", 5, max_tokens=20)
    engine.step()
    long = _request(engine, "long", 60)
    short = _request(engine, "short", 4)
    spans = _count_forwards(engine)
    while not long.output_token_ids:
        engine.step()
    # Four chunks (16, 16, 16, 12), each beside the running request's next token; the short
    # prompt joins the first chunk's step whole and decodes in the steps after it.
    assert spans == [[1, 16, 4], [1, 1, 16], [1, 1, 16], [1, 1, 12]]
    assert len(running.output_token_ids) == 5 and len(short.output_token_ids) == 4
    while engine.has_work():
        engine.step()
    assert engine.kv_cache.is_empty()


# --- the same output -----------------------------------------------------------------------


def _sampling_mix(n: int, seed: int) -> list[SamplingParams]:
    """Greedy and seeded sampled requests of varied lengths, some stopping on EOS."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        length = rng.randint(1, 24)
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=length, temperature=0))
        elif i % 3 == 1:
            params.append(
                SamplingParams(
                    max_tokens=length, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True
                )
            )
        else:
            params.append(SamplingParams(max_tokens=length, temperature=1.1, top_k=40, seed=i))
    return params


@pytest.mark.parametrize("chunk", [0, 5, 16])
def test_greedy_and_seeded_output_is_unchanged(tiny_model_path: Path, chunk: int):
    prompts = _prompts(14, seed=chunk)
    expected, got, _ = _both(
        tiny_model_path, prompts, _sampling_mix(14, seed=chunk), chunked_prefill_size=chunk
    )
    assert _summary(got) == _summary(expected)


def test_parallel_samples_are_unchanged(tiny_model_path: Path):
    prompts = _prompts(5, seed=11, longest=30)
    params = [
        SamplingParams(n=3, max_tokens=4 + 3 * i, temperature=0.9, seed=5, ignore_eos=True)
        for i in range(5)
    ]
    expected, got, _ = _both(tiny_model_path, prompts, params, max_num_seqs=6)
    assert _summary(got) == _summary(expected)


def test_parallel_samples_of_a_chunked_prompt_are_unchanged(tiny_model_path: Path):
    prompts = _prompts(4, seed=12, longest=30) + [list(range(3, 50))]
    params = SamplingParams(n=2, max_tokens=9, temperature=0.8, seed=2, ignore_eos=True)
    expected, got, _ = _both(
        tiny_model_path, prompts, params, max_num_seqs=5, chunked_prefill_size=8
    )
    assert _summary(got) == _summary(expected)


def test_processors_and_logprobs_are_unchanged(tiny_model_path: Path):
    prompts = _prompts(10, seed=21)
    params = [
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.4),
        SamplingParams(max_tokens=12, temperature=0.7, seed=3, frequency_penalty=0.8),
        SamplingParams(max_tokens=9, temperature=0, presence_penalty=1.2, logprobs=3),
        SamplingParams(max_tokens=11, temperature=0, logit_bias={40: 5.0, 41: -100.0}),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=10),
        SamplingParams(max_tokens=8, temperature=0.9, seed=8, logprobs=0),
    ] * 2
    params = params[:10]
    expected, got, _ = _both(tiny_model_path, prompts, params)
    assert _summary(got) == _summary(expected)
    for want, have in zip(expected, got):
        assert (want.logprobs is None) == (have.logprobs is None)
        for a, b in zip(want.logprobs or [], have.logprobs or []):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_grammar_output_is_unchanged(tiny_model_path: Path):
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["x"],
        "additionalProperties": False,
    }
    grammar = json_schema_grammar(schema, "response_format")
    prompts = _prompts(8, seed=31)
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, seed=i, grammar=grammar)
        if i % 2
        else SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True)
        for i in range(8)
    ]
    expected, got, _ = _both(tiny_model_path, prompts, params)
    assert _summary(got) == _summary(expected)
    assert all(o.text.startswith('{"x":') for o in got[1::2])


def test_prompt_vectors_are_unchanged(tiny_model_path: Path):
    prompts = _prompts(8, seed=41)
    rng = torch.Generator().manual_seed(0)
    embeds = [
        {0: torch.randn(64, generator=rng), len(p) - 1: torch.randn(64, generator=rng)}
        if i % 2
        else None
        for i, p in enumerate(prompts)
    ]
    expected, got, _ = _both(
        tiny_model_path,
        prompts,
        GREEDY,
        generate={"prompt_embeds": embeds},
        chunked_prefill_size=6,
    )
    assert _summary(got) == _summary(expected)


def test_stop_strings_and_tokens_are_unchanged(tiny_model_path: Path):
    prompts = _prompts(10, seed=51)
    unmixed = _llm(tiny_model_path, False)
    free = unmixed.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    # Stop at text and tokens each answer would give: answers end in the middle.
    params = [
        SamplingParams(max_tokens=16, temperature=0, stop=[o.text[3:5]])
        if i % 2 and len(o.text) > 5
        else SamplingParams(max_tokens=16, temperature=0, stop_token_ids=o.token_ids[4:5])
        for i, o in enumerate(free)
    ]
    expected, got, _ = _both(tiny_model_path, prompts, params)
    assert _summary(got) == _summary(expected)
    assert any(len(o.token_ids) < 16 for o in got)


def test_retraction_output_is_unchanged(tiny_model_path: Path):
    """A pool too small for every running request: both engines retract, and retracted
    requests prefilled again (here beside the running ones) give the same tokens."""
    prompts = _prompts(10, seed=61, longest=24)
    params = _sampling_mix(10, seed=61)
    params = [dataclasses.replace(p, max_tokens=30, ignore_eos=True) for p in params]
    kw = dict(kv_cache_tokens=150, max_num_seqs=6)
    expected, got, mixed = _both(tiny_model_path, prompts, params, **kw)
    assert _summary(got) == _summary(expected)
    assert mixed.engine.scheduler.num_retractions > 0


def test_overlapped_steps_read_the_step_in_flight_before_a_mixed_step(tiny_model_path: Path):
    prompts = _prompts(12, seed=71)
    params = _sampling_mix(12, seed=71)
    expected = _llm(tiny_model_path, False).generate(prompts, params)
    llm = _llm(tiny_model_path, True, overlap_schedule=True)
    batches = _recorded(llm)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(expected)
    engine = llm.engine
    assert _mixed_steps(batches) > 0 and engine.overlap.num_overlapped_steps > 0
    assert engine.overlap.in_flight is None and engine.kv_cache.is_empty()


def test_decode_steps_keep_overlapping_while_prompts_wait_for_a_seat(tiny_model_path: Path):
    """Every seat taken: the prompts that wait change nothing in the next step, which is
    launched before the one in flight is read; the step after a request finishes admits."""
    prompts = _prompts(8, seed=72)
    params = _sampling_mix(8, seed=72)
    expected = _llm(tiny_model_path, False).generate(prompts, params)
    llm = _llm(tiny_model_path, True, overlap_schedule=True, max_num_seqs=2)
    engine = llm.engine
    overlapped_while_waiting = 0
    step = engine.overlap.step

    def watching():
        nonlocal overlapped_while_waiting
        waiting = bool(engine.scheduler.waiting)
        finished = step()
        overlapped_while_waiting += waiting and finished is not None
        return finished

    engine.overlap.step = watching
    batches = _recorded(llm)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(expected)
    assert overlapped_while_waiting > 0 and _mixed_steps(batches) > 0
    assert engine.kv_cache.is_empty()


def test_an_abort_between_chunks_leaves_the_running_requests_as_they_were(tiny_model_path: Path):
    llm = _llm(tiny_model_path, True, chunked_prefill_size=8)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [alone] = llm.generate([[9, 8, 7, 6]], greedy)
    running = _request(engine, "running", 4, max_tokens=12, prompt=[9, 8, 7, 6])
    engine.step()
    long = _request(engine, "long", 40)
    used = _held_slots(engine)
    engine.step()  # the first chunk, beside the running request's next token
    assert long.kv_len == 8 and len(running.output_token_ids) == 2
    assert _held_slots(engine) == used + 8 + 1
    assert engine.abort("long") is long
    assert _held_slots(engine) == used + 1
    while engine.has_work():
        engine.step()
    assert running.output_token_ids == alone.token_ids and engine.kv_cache.is_empty()


def _held_slots(engine) -> int:
    """Slots some request holds: used ones, less those only the prefix cache keeps (free to
    evict)."""
    cache = engine.kv_cache.prefix_cache
    return engine.kv_cache.kv_pool.allocator.num_used - (cache.evictable_size if cache else 0)


# --- budget and reservation ----------------------------------------------------------------


def test_the_decode_tokens_count_in_the_steps_token_budget(tiny_model_path: Path):
    # A chunk gets what the running requests' tokens leave of max_prefill_tokens.
    engine = _llm(tiny_model_path, True, chunked_prefill_size=16, max_prefill_tokens=12).engine
    for i in range(3):
        _request(engine, f"r{i}", 3 + i, max_tokens=20)
    engine.step()
    spans = _count_forwards(engine)
    _request(engine, "long", 40)
    engine.step()
    assert spans == [[1, 1, 1, 9]]
    # Whole prompts: the first always, the next only within the budget. (The three prompts
    # are the same: without the prefix cache, each is computed whole.)
    engine = _llm(
        tiny_model_path, True, 0, max_prefill_tokens=12, max_num_seqs=8, enable_prefix_cache=False
    ).engine
    for i in range(3):
        _request(engine, f"r{i}", 3 + i, max_tokens=20)
    engine.step()
    spans = _count_forwards(engine)
    for name in ("a", "b", "c"):
        _request(engine, name, 5)
    engine.step()
    engine.step()
    assert spans == [[1, 1, 1, 5], [1, 1, 1, 1, 5]]


def test_a_chunk_the_decode_tokens_leave_no_room_for_runs_in_a_step_of_its_own(
    tiny_model_path: Path,
):
    engine = _llm(tiny_model_path, True, chunked_prefill_size=16, max_prefill_tokens=3).engine
    for i in range(3):
        _request(engine, f"r{i}", 1, max_tokens=20)
    engine.step()
    spans = _count_forwards(engine)
    long = _request(engine, "long", 10)
    while not long.output_token_ids:
        engine.step()
    # As without mixing: chunks of the whole budget, a decode step between them.
    assert spans == [[3], [1, 1, 1], [3], [1, 1, 1], [3], [1, 1, 1], [1]]


def _free_slots(engine: EngineCore) -> int:
    return engine.kv_cache.kv_pool.allocator.num_free


def test_a_mixed_step_keeps_the_next_steps_slots_free(tiny_model_path: Path):
    """Admitting beside the running requests takes their slots for this step and keeps
    those of the next one free: with too few slots for both, the prompt gets a step of its own
    (as without mixing), and no step retracts a request."""
    engine = _llm(tiny_model_path, True, kv_cache_tokens=40).engine
    running = [_request(engine, f"r{i}", 6, max_tokens=30) for i in range(3)]
    engine.step()  # 18 slots held, 22 free; each running request needs 1 a step
    assert _free_slots(engine) == 22
    spans = _count_forwards(engine)
    # 17 + 3 (this step's decodes) + 3 + 1 (the next step's) = 24 > 22: not beside them.
    _request(engine, "wide", 17)
    engine.step()
    # 17 + 3 + 1 <= 22: alone, as a prefill step followed by a decode step would need.
    assert spans == [[17]]
    assert all(len(req.output_token_ids) == 1 for req in running)
    engine.step()
    assert spans[-1] == [1, 1, 1, 1] and engine.scheduler.num_retractions == 0


def test_no_step_after_a_mixed_step_retracts(tiny_model_path: Path):
    prompts = _prompts(16, seed=81, longest=20)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = _llm(tiny_model_path, True, kv_cache_tokens=160, max_num_seqs=8)
    engine = llm.engine
    scheduler = engine.scheduler
    history: list[str] = []
    retract = scheduler._retract
    scheduler._retract = lambda req: (history.append("retract"), retract(req))[1]
    batches = _recorded(llm)
    step = engine.step

    def marking():
        seen = len(batches)
        finished = step()
        if len(batches) > seen:
            history.append("mixed" if batches[-1].decoding else "step")
            # The next step's decode fits: every running request's next slot is free.
            if batches[-1].decoding:
                assert engine.kv_cache.can_grow(scheduler.step_reserve())
        return finished

    engine.step = marking
    llm.generate(prompts, params)
    assert "retract" in history and "mixed" in history
    after_mixed = [history[i + 1] for i, kind in enumerate(history[:-1]) if kind == "mixed"]
    assert "retract" not in after_mixed


def test_a_mixed_step_larger_than_its_limit_is_left_a_prefill_step(tiny_model_path: Path):
    # "wide" begins with "fits"'s tokens: without the prefix cache, it is computed whole.
    engine = _llm(tiny_model_path, True, enable_prefix_cache=False).engine
    engine.scheduler.mixed_max_tokens = 12
    for i in range(2):
        _request(engine, f"r{i}", 4, max_tokens=20)
    engine.step()
    spans = _count_forwards(engine)
    _request(engine, "fits", 10)  # 2 decode tokens + 10
    engine.step()
    _request(engine, "wide", 11)  # 3 + 11 > 12: a step of its own, as without mixing
    engine.step()
    assert spans == [[1, 1, 10], [11]]


def test_where_decode_steps_replay_graphs_only_a_graph_holds_a_mixed_step():
    config = EngineConfig(device="cpu")
    assert mixed_step_tokens(config) is None
    graphs = dataclasses.replace(config, cuda_graph_max_bs=8, cuda_graph_max_prefill_tokens=256)
    assert mixed_step_tokens(graphs) == 256
    assert mixed_step_tokens(dataclasses.replace(graphs, cuda_graph_max_prefill_tokens=0)) == 0


# --- what does not mix, the switch, traces -------------------------------------------------


def test_a_speculating_engine_keeps_its_steps_apart(tiny_model_path: Path):
    llm = _llm(tiny_model_path, True)
    speculator = SimpleNamespace(
        release=lambda req: None, num_draft_steps=2, prefix_companion=lambda: None
    )
    engine = EngineCore(llm.engine.runner, llm.tokenizer, speculator)  # type: ignore[arg-type]
    assert not engine.scheduler.mixed and llm.engine.scheduler.mixed
    assert not EngineCore(llm.engine.runner, llm.tokenizer, handoff=object()).scheduler.mixed


def test_the_switch_reaches_the_engine_from_the_command_line(tiny_model_path: Path):
    from cluster.commands.cli_args import add_engine_args
    from cluster.commands.cli_commands import engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args(parser.parse_args([])).mixed_prefill is True
    off = engine_args(parser.parse_args(["--disable-mixed-prefill"]))
    assert off.mixed_prefill is False
    args = EngineArgs(model=str(tiny_model_path), device="cpu", kv_cache_tokens=256)
    assert resolve(args).engine_config.mixed_prefill is True
    off = EngineArgs(
        model=str(tiny_model_path), device="cpu", kv_cache_tokens=256, mixed_prefill=False
    )
    assert resolve(off).engine_config.mixed_prefill is False


def test_a_mixed_step_stamps_prefill_for_its_prompts_and_decode_for_the_others(
    tiny_model_path: Path,
):
    llm = _llm(tiny_model_path, True, enable_tracing=True)
    engine = llm.engine
    running = _request(engine, "running", 5, max_tokens=6)
    engine.step()
    prompt = _request(engine, "new", 7, max_tokens=3)
    engine.step()
    names = running.trace.names()
    assert names[-2:] == ["decode_start", "decode_end"] and "prefill_start" in names
    assert prompt.trace.names() == ["queued", "prefill_start", "prefill_end"]
    while engine.has_work():
        engine.step()
    for req in (running, prompt):
        names = req.trace.names()
        assert names.count("prefill_start") == names.count("prefill_end") == 1
        decodes = len(req.output_token_ids) - 1
        assert names.count("decode_start") == names.count("decode_end") == decodes


# --- attention over a mixed batch ----------------------------------------------------------


def test_the_torch_backend_batches_a_mixed_steps_decodes_as_it_attends_each(
    tiny_model_path: Path,
):
    engine = _llm(tiny_model_path, True, max_num_seqs=8).engine
    requests = [_request(engine, f"r{i}", 4 + 3 * i, max_tokens=20) for i in range(4)]
    engine.step()
    engine.step()
    _request(engine, "new", 30)
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.decoding == requests
    runner = engine.runner
    order = batch.decoding + batch.requests
    ends = [req.num_tokens for req in batch.decoding] + batch.ends
    forward = runner.build_batch(order, ends)
    meta = forward.attn_metadata
    assert isinstance(meta, PerRequestMetadata)
    assert len(meta.batched) == 1 and [start for start, *_ in meta.spans] == [4]
    logits = runner.forward(forward).logits
    starts = [0, 1, 2, 3, 4]
    forward.attn_metadata = PerRequestMetadata(prepare_per_request(forward, range(5), starts))
    assert torch.allclose(runner.forward(forward).logits, logits, atol=1e-5)


# --- on a GPU: graphs ----------------------------------------------------------------------


def needs_gpu(test):
    skip = pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
    return pytest.mark.gpu(skip(test))


@needs_gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_replay_prefill_graphs_with_the_eager_tokens(
    tiny_model_path: Path, overlap: bool
):
    prompts = _prompts(24, seed=91, longest=60)
    params = _sampling_mix(24, seed=91)
    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=8192, max_num_seqs=6)
    eager = LLM(str(tiny_model_path), mixed_prefill=False, disable_cuda_graph=True, **kw)
    expected = eager.generate(prompts, params)
    graphs = LLM(
        str(tiny_model_path),
        cuda_graph_max_prefill_tokens=128,
        overlap_schedule=overlap,
        chunked_prefill_size=32,
        **kw,
    )
    prefill_graphs = graphs.engine.runner.prefill_graphs
    assert prefill_graphs is not None
    batches = _recorded(graphs)
    replays = []
    run = graphs.engine._prefill

    def counting(batch):
        before = prefill_graphs.num_replays
        finished = run(batch)
        if batch.decoding:
            replays.append(prefill_graphs.num_replays - before)
        return finished

    graphs.engine._prefill = counting
    got = graphs.generate(prompts, params)
    assert _summary(got) == _summary(expected)
    # Every mixed step replayed a graph: a step too large for one was left a prefill step.
    assert _mixed_steps(batches) == len(replays) > 0 and set(replays) == {1}
    assert graphs.engine.kv_cache.is_empty()
