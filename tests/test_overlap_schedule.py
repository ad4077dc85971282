"""Overlap scheduling (engine/executor/overlap.py): each plain decode step is launched before the
tokens of the step before are read, with those tokens fed to it on the device. The output must be
the output without overlap, token for token, whatever joins, stops, aborts, retracts or fails on the
way, and every slot must come back. On the CPU host and device are one, so nothing overlaps in time,
but every path of the bookkeeping runs; the GPU test runs it with graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.kernels import triton_runs_on
from engine.request import Request

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 60 + i, 71][: 3 + i % 4] for i in range(6)]


def _llm(path: Path, overlap: bool, **kwargs) -> LLM:
    kwargs = {"kv_cache_tokens": 4096, "max_num_seqs": 8, **kwargs}
    return LLM(str(path), device="cpu", overlap_schedule=overlap, **kwargs)


def _mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampled requests, stopping by a stop token, a stop string and
    max_tokens (on the tiny model, the first request's fourth token is 274, the fourth's
    ninth a "<")."""
    return [
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[274]),
        SamplingParams(max_tokens=30, temperature=0.9, seed=7),
        SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=11),
        SamplingParams(max_tokens=18, temperature=0, stop=["<"]),
        SamplingParams(max_tokens=35, temperature=1.2, top_k=20, seed=3),
        SamplingParams(max_tokens=1, temperature=0),
    ]


def _outputs(llm: LLM, params: list[SamplingParams]) -> list[tuple[list[int], str, str]]:
    outs = llm.generate(PROMPTS, params)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def test_overlapped_output_equals_sequential(tiny_model_path: Path) -> None:
    params = _mixed_params()
    plain = _llm(tiny_model_path, overlap=False)
    overlapped = _llm(tiny_model_path, overlap=True)
    assert plain.engine.overlap is None
    assert _outputs(overlapped, params) == _outputs(plain, params)
    engine = overlapped.engine
    assert engine.overlap is not None and engine.overlap.num_overlapped_steps > 20
    assert engine.overlap.in_flight is None and not engine.has_work()
    assert engine.kv_cache.is_empty()
    # Two requests stopped by what they sampled, with a step after it already launched.
    outputs = _outputs(overlapped, params)
    assert [o[2] for o in outputs][:4] == ["stop", "length", "length", "stop"]
    assert len(outputs[0][0]) == 4 and len(outputs[3][0]) == 9


def test_requests_that_read_the_host_step_without_overlap(tiny_model_path: Path) -> None:
    """A request with logprobs, a penalty or min_tokens in the batch: those steps wait for
    their tokens (no step of theirs overlaps), and the output is unchanged."""
    special = [
        SamplingParams(max_tokens=12, temperature=0, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=10),
    ]
    for extra in special:
        params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), extra]
        plain = _llm(tiny_model_path, overlap=False)
        overlapped = _llm(tiny_model_path, overlap=True)
        expected = plain.generate(PROMPTS[:2], params)
        got = overlapped.generate(PROMPTS[:2], params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [o.logprobs for o in got] == [o.logprobs for o in expected]
        assert overlapped.engine.overlap.num_overlapped_steps == 0


def test_on_by_default_on_a_gpu_only_and_off_by_flag(tiny_model_path: Path, tmp_path) -> None:
    import argparse
    import dataclasses

    from cluster.commands.cli_args import add_engine_args
    from cluster.commands.cli_commands import engine_args
    from engine.loading.loader import EngineArgs, resolve

    args = EngineArgs(model=str(tiny_model_path), device="cpu", kv_cache_tokens=256)
    assert resolve(args).engine_config.overlap_schedule is False
    forced = dataclasses.replace(args, overlap_schedule=True)
    assert resolve(forced).engine_config.overlap_schedule is True
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args(parser.parse_args([])).overlap_schedule is None
    assert engine_args(parser.parse_args(["--disable-overlap-schedule"])).overlap_schedule is False
    if triton_runs_on("cuda"):
        gpu = dataclasses.replace(args, device="cuda")
        assert resolve(gpu).engine_config.overlap_schedule is True
        dump = dataclasses.replace(gpu, debug_tensor_dump_dir=str(tmp_path / "dump"))
        assert resolve(dump).engine_config.overlap_schedule is False


def _drive(engine: EngineCore, schedule: dict[int, list[Request]], aborts: dict[int, str]):
    """Step the engine, adding requests and aborting ids at the given step numbers."""
    step = 0
    while engine.has_work() or any(k >= step for k in schedule):
        for req in schedule.get(step, []):
            engine.add_request(req)
        if step in aborts:
            engine.abort(aborts[step])
        engine.step()
        step += 1
        assert step < 500


def _requests(engine: EngineCore, n: int, offset: int = 0) -> list[Request]:
    return [
        engine.make_request(
            f"r{offset + i}",
            PROMPTS[(offset + i) % len(PROMPTS)],
            SamplingParams(max_tokens=10 + 5 * i, temperature=0.8, seed=offset + i),
        )
        for i in range(n)
    ]


def test_joins_and_aborts_mid_flight(tiny_model_path: Path) -> None:
    """Requests join while a step is in flight (a prefill between overlapped steps) and one is
    aborted with a token in flight: the others' tokens are unchanged and every slot returns."""
    results = []
    for overlap in (False, True):
        engine = _llm(tiny_model_path, overlap=overlap).engine
        first, later = _requests(engine, 3), _requests(engine, 3, offset=3)
        _drive(engine, {0: first, 4: later[:2], 9: later[2:]}, {12: "r1"})
        results.append([(r.output_token_ids, r.finish_reason) for r in first + later])
        assert engine.kv_cache.is_empty()
        if overlap:
            assert engine.overlap.num_overlapped_steps > 10
    plain, overlapped = results
    assert overlapped[1][1] == "abort"
    assert [r for i, r in enumerate(overlapped) if i != 1] == [
        r for i, r in enumerate(plain) if i != 1
    ]


def test_retraction_under_overlap(tiny_model_path: Path) -> None:
    """A pool too small for every answer: the running requests are retracted on the way (the
    step in flight is read first) and still give their output."""
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * 4
    kwargs = {"kv_cache_tokens": 160, "max_model_len": 96}
    plain = _llm(tiny_model_path, overlap=False, **kwargs)
    overlapped = _llm(tiny_model_path, overlap=True, **kwargs)
    expected = plain.generate(PROMPTS[:4], params)
    got = overlapped.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert overlapped.engine.scheduler.num_retractions > 0
    assert overlapped.engine.overlap.num_overlapped_steps > 0
    assert overlapped.engine.kv_cache.is_empty()


def test_a_failed_overlapped_step_ends_its_requests(tiny_model_path: Path) -> None:
    """A forward that fails with a step in flight: that step's tokens are committed, the
    running requests end with an error naming the decode forward, their slots come back, and
    the engine serves the next request."""
    llm = _llm(tiny_model_path, overlap=True)
    engine = llm.engine
    reqs = _requests(engine, 2)
    for req in reqs:
        engine.add_request(req)
    runner = engine.runner
    forward = runner.forward
    calls = {"n": 0}

    def failing(batch, keep_hidden=False):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("device lost")
        return forward(batch, keep_hidden)

    runner.forward = failing
    try:
        while engine.has_work():
            engine.step()
    finally:
        runner.forward = forward
    for req in reqs:
        assert req.finish_reason == "error"
        assert "decode forward failed: RuntimeError: device lost" in req.error
        assert len(req.output_token_ids) >= 3  # the step in flight was read first
    assert engine.kv_cache.is_empty()
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0))
    assert len(out.token_ids) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
def test_overlap_with_cuda_graphs_equals_sequential(tiny_model_path: Path) -> None:
    """Graphs on: the next step's input tokens are copied into the graph's buffer on the
    device; batches shrink as requests stop, and a join makes a step wait."""
    outputs = []
    for overlap in (False, True):
        llm = LLM(str(tiny_model_path), device="cuda", dtype="float32", max_num_seqs=12,
                  kv_cache_tokens=4096, overlap_schedule=overlap)  # fmt: skip
        engine = llm.engine
        first, later = _requests(engine, 6), _requests(engine, 6, offset=6)
        _drive(engine, {0: first, 3: later[:3], 8: later[3:]}, {})
        outputs.append([r.output_token_ids for r in first + later])
        assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
        assert engine.kv_cache.is_empty()
        if overlap:
            assert engine.overlap.num_overlapped_steps > 10
    assert outputs[0] == outputs[1]


def _join_with_cached_prompt(engine: EngineCore, req: Request) -> None:
    """What a decode node does when a request's KV has landed: the prompt's KV cached in the
    request's slots and its first token sampled elsewhere (here: by this engine's own runner,
    outside any step), then `Scheduler.add_running`."""
    n = len(req.prompt_token_ids)
    engine.kv_cache.grow(req, n + 1)
    output = engine.runner.forward(engine.runner.build_batch([req], [n]))
    req.commit(int(output.logits[0].argmax()))
    req.kv_len = n
    engine.scheduler.add_running(req)


def test_requests_joining_with_their_kv_join_the_overlapped_steps(tiny_model_path: Path) -> None:
    """Requests that join decoding with their prompt's KV already cached (a decode node's
    transfers) join the next overlapped step without waiting for the one in flight; every
    request's tokens are those without overlap."""
    results, overlapped = [], []
    for overlap in (False, True):
        engine = _llm(tiny_model_path, overlap=overlap).engine
        first = _requests(engine, 3)
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        joining = [engine.make_request(f"j{i}", PROMPTS[i], greedy) for i in range(3)]
        for req in first:
            engine.add_request(req)
        step = 0
        while engine.has_work():
            if step in (4, 6, 7):
                _join_with_cached_prompt(engine, joining[(4, 6, 7).index(step)])
            engine.step()
            step += 1
        results.append([r.output_token_ids for r in first + joining])
        assert engine.kv_cache.is_empty()
        if overlap:
            overlapped.append(engine.overlap.num_overlapped_steps)
            decode_steps = step - 1  # all but the prefill
    plain, with_overlap = results
    assert with_overlap == plain
    # Every decode step overlapped but the first (launched alone) and the last (nothing left to
    # launch: it reads the step in flight): no join made the engine wait.
    assert overlapped[0] == decode_steps - 2
