"""Prefill steps replayed from CUDA graphs (padded to a captured token count): the flags that turn
them on, and on a GPU that they change nothing. Greedy tokens equal the eager prefill's, chunks
and joins included; the draft's prefill gets exactly the rows an eager prefill hands it (the
input vectors of prompt_embeds copied out of the graph's buffer and sliced to the real tokens,
the hidden states); the draft's own prefill replays its depths' prefill graphs with the eager
forward's outputs; speculation over graph-run prefills stays lossless."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor.prompt_embeds import PromptEmbeds
from engine.kernels import triton_runs_on
from engine.loading.loader import EngineArgs, resolve


def needs_gpu(test):
    skip = pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
    return pytest.mark.gpu(skip(test))


def test_prefill_graphs_follow_the_graph_flags(tiny_model_path: Path, tmp_path) -> None:
    args = EngineArgs(model=str(tiny_model_path), device="cpu", kv_cache_tokens=256)
    assert resolve(args).engine_config.cuda_graph_max_prefill_tokens == 0
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens must be >= 0"):
        EngineArgs(model=str(tiny_model_path), cuda_graph_max_prefill_tokens=-1)
    import argparse

    from cluster.commands.cli_args import add_engine_args
    from cluster.commands.cli_commands import engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args(parser.parse_args([])).cuda_graph_max_prefill_tokens is None
    flag = ["--cuda-graph-max-prefill-tokens", "0"]
    assert engine_args(parser.parse_args(flag)).cuda_graph_max_prefill_tokens == 0
    if not triton_runs_on("cuda"):
        return
    gpu = dataclasses.replace(args, device="cuda", max_num_seqs=16)

    def tokens(**changes) -> tuple[int, int]:
        config = resolve(dataclasses.replace(gpu, **changes)).engine_config
        return config.cuda_graph_max_prefill_tokens, config.cuda_graph_max_bs

    assert tokens() == (512, 16)
    assert tokens(cuda_graph_max_prefill_tokens=64) == (64, 16)
    assert tokens(cuda_graph_max_prefill_tokens=0) == (0, 16)
    assert tokens(max_prefill_tokens=100) == (100, 16)
    assert tokens(disable_cuda_graph=True) == (0, 0)
    assert tokens(debug_tensor_dump_dir=str(tmp_path / "dump")) == (0, 0)


def _gpu_llm(path: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 8192)
    kw.setdefault("max_num_seqs", 12)
    return LLM(str(path), device="cuda", dtype="float32", **kw)


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 300))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


@needs_gpu
@pytest.mark.parametrize("chunk", [None, 48])
def test_graph_run_prefills_give_the_eager_prefills_tokens(tiny_model_path: Path, chunk) -> None:
    prompts, params = _workload(24, seed=2)
    kw = {} if chunk is None else {"chunked_prefill_size": chunk}
    graphs = _gpu_llm(tiny_model_path, cuda_graph_max_prefill_tokens=256, **kw)
    eager = _gpu_llm(tiny_model_path, cuda_graph_max_prefill_tokens=0, **kw)
    assert graphs.engine.runner.prefill_graphs is not None
    assert eager.engine.runner.prefill_graphs is None
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert graphs.engine.runner.prefill_graphs.num_replays > 0
    assert got == [o.token_ids for o in eager.generate(prompts, params)]


@needs_gpu
def test_a_graph_run_prefill_hands_the_draft_the_eager_rows(tiny_model_path: Path) -> None:
    """One prefill step with vectors given for some positions, run through a graph and then
    eagerly over the same requests: the rows the draft's prefill reads (hidden states at every
    real token, the input vectors and their mask) and the logits agree, and the graph's rows
    stop at the real token count."""
    llm = _gpu_llm(tiny_model_path, cuda_graph_max_prefill_tokens=256)
    core, runner = llm.engine, llm.engine.runner
    hidden_size = runner.model_config.hidden_size
    generator = torch.Generator().manual_seed(0)
    given = {1: torch.randn(hidden_size, generator=generator), 4: torch.randn(hidden_size)}
    requests = [
        core.make_request("a", list(range(5, 30)), SamplingParams(max_tokens=2)),
        core.make_request(
            "b",
            list(range(40, 47)),
            SamplingParams(max_tokens=2),
            prompt_embeds=PromptEmbeds.of(given),
        ),
    ]
    for req in requests:
        core.add_request(req)
    batch = core.scheduler.schedule()
    assert batch is not None and batch.is_prefill
    graph_batch = runner.build_batch(batch.requests, batch.ends)
    assert graph_batch.graph is runner.prefill_graphs and graph_batch.graph_batch_size == 32
    graphed = runner.forward(graph_batch, keep_hidden=True)
    prefill_graphs, runner.prefill_graphs = runner.prefill_graphs, None
    try:
        eager_batch = runner.build_batch(batch.requests, batch.ends)
        assert eager_batch.graph is None
        eager = runner.forward(eager_batch, keep_hidden=True)
    finally:
        runner.prefill_graphs = prefill_graphs
    assert graphed.hidden.shape == eager.hidden.shape == (32, runner.model_config.hidden_size)
    torch.testing.assert_close(graphed.hidden, eager.hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed.logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert graphed.input_embeds is not None and eager.input_embeds is not None
    assert len(graphed.input_embeds) == 32
    assert torch.equal(graphed.input_embeds.mask, eager.input_embeds.mask)
    assert torch.equal(graphed.input_embeds.values[graphed.input_embeds.mask],
                       eager.input_embeds.values[eager.input_embeds.mask])  # fmt: skip
    assert graphed.input_embeds.mask.sum() == 2
    # The rows are copies: the next replay leaves them alone.
    kept = graphed.hidden.clone()
    runner.forward(runner.build_batch(batch.requests, batch.ends), keep_hidden=True)
    assert torch.equal(graphed.hidden, kept)


@needs_gpu
def test_speculation_over_graph_run_prefills_is_lossless(tmp_path_factory) -> None:
    from tiny_drafts import make_random_draft
    from tiny_models import make_tiny_llama

    root = tmp_path_factory.mktemp("prefill_graph_spec")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "draft", root / "target", 3, seed=1)
    # Short prompts: each prefill step fits a graph of 256 tokens.
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0) for _ in prompts]
    plain = _gpu_llm(root / "target", cuda_graph_max_prefill_tokens=0)
    hidden = plain.model_config.hidden_size
    embeds = [
        None if i % 2 else PromptEmbeds.of({0: torch.full((hidden,), 0.01 * i)})
        for i in range(len(prompts))
    ]
    expected = [o.token_ids for o in plain.generate(prompts, params, prompt_embeds=embeds)]
    spec = _gpu_llm(
        root / "target",
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(root / "draft"),
        cuda_graph_max_prefill_tokens=256,
    )
    got = [o.token_ids for o in spec.generate(prompts, params, prompt_embeds=embeds)]
    assert spec.engine.runner.prefill_graphs.num_replays > 0
    assert got == expected


@needs_gpu
def test_the_drafts_prefill_runs_in_graphs_as_it_runs_eagerly(tmp_path_factory) -> None:
    """Every depth's prefill (prompts with vectors given for positions every depth reads)
    replays a prefill graph of its own; its outputs at every real token are the eager
    forward's (the vectors reach the graph, the rows stop at the real token count), and so is
    its proposal at each prompt's last position."""
    from tiny_drafts import make_random_draft
    from tiny_models import make_tiny_llama

    root = tmp_path_factory.mktemp("draft_prefill_graph")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "draft", root / "target", 3, seed=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(6, 20))] for _ in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0)
    spec = _gpu_llm(
        root / "target",
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(root / "draft"),
        cuda_graph_max_prefill_tokens=256,
    )
    hidden = spec.model_config.hidden_size
    # Depth d reads position p at row p - d - 1: positions 3 and 4 reach every depth.
    embeds = [
        PromptEmbeds.of({p: torch.full((hidden,), 0.03 * (i + p)) for p in (1, 3, 4)})
        if i % 2
        else None
        for i in range(len(prompts))
    ]
    depths = spec.engine.speculator.depths
    seen: list[list[torch.Tensor]] = [[] for _ in depths]
    for runner, outputs in zip(depths, seen):
        forward_flat = runner.forward_flat

        def record(inputs, patch=None, forward_flat=forward_flat, outputs=outputs):
            out, lens, proposal = forward_flat(inputs, patch)
            outputs.append((out.clone(), lens, proposal))
            return out, lens, proposal

        runner.forward_flat = record
    graphed = [o.token_ids for o in spec.generate(prompts, params, prompt_embeds=embeds)]
    assert all(runner.prefill_graphs.num_replays > 0 for runner in depths)
    prefills = [outputs[0] for outputs in seen]
    for runner, outputs in zip(depths, seen):
        runner.prefill_graphs = None
        outputs.clear()
    eager = [o.token_ids for o in spec.generate(prompts, params, prompt_embeds=embeds)]
    assert graphed == eager
    for runner, (graph_rows, lens, proposal), outputs in zip(depths, prefills, seen):
        rows, eager_lens, eager_proposal = outputs[0]
        assert eager_proposal is None and lens == eager_lens
        assert graph_rows.shape == rows.shape  # the real tokens, no padding
        torch.testing.assert_close(graph_rows, rows, rtol=1e-4, atol=1e-4)
        last = torch.tensor(lens, device=rows.device).cumsum(0) - 1
        with torch.inference_mode():
            top, top_p = runner.head.propose_top(rows[last], runner.num_proposed)
        assert torch.equal(proposal.top[: len(lens)], top)
        torch.testing.assert_close(proposal.top_p[: len(lens)], top_p, rtol=1e-4, atol=1e-5)
