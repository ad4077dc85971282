"""CUDA graphs for decode: which batch sizes are captured, when graphs are on, and (on a GPU)
that replaying them changes nothing: greedy tokens equal the eager engine's with requests
joining and leaving mid-batch, padded rows write only the padding slot, and a poisoned padding
slot changes no output."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.attention import resolve_attention_backend
from engine.executor.forward_batch import Span
from engine.executor.graph_inputs import (
    batch_size_buckets,
    bucket_for,
    padded_columns,
    token_buckets,
    uniform_columns,
)
from engine.kernels import triton_runs_on
from engine.loading.loader import EngineArgs, resolve
from engine.scheduling.allocator import PADDING_SLOT
from engine.scheduling.kv_pool import ReqToTokenPool


def needs_gpu(test):
    skip = pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
    return pytest.mark.gpu(skip(test))


def test_buckets_cover_every_batch_size_up_to_the_largest() -> None:
    assert batch_size_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    assert batch_size_buckets(1) == [1]
    big = batch_size_buckets(300)
    assert big[-3:] == [256, 288, 300] and big == sorted(set(big))
    for max_bs in (1, 3, 17, 64, 100):
        buckets = batch_size_buckets(max_bs)
        for n in range(1, max_bs + 1):
            size = bucket_for(buckets, n)
            assert size is not None and n <= size <= max_bs
        assert bucket_for(buckets, max_bs + 1) is None


def test_token_buckets_for_verify() -> None:
    assert token_buckets(1024) == [8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert token_buckets(13) == [8, 13] and token_buckets(4) == [4]


def test_padding_columns_keep_every_real_token_and_send_padding_to_the_padding_slot() -> None:
    spans = [Span(3, 10, [7, 8, 9, 10], [41, 42, 43, 44]), Span(5, 2, [11, 12, 13], [51, 52, 53])]
    columns = padded_columns(12, spans, padding_row=9)
    ids, positions, slots, rows, seq_lens, starts, lens, lasts = columns
    # The spans' tokens first, in order, each at its position and slot.
    assert ids[:7] == [7, 8, 9, 10, 11, 12, 13]
    assert positions[:7] == [10, 11, 12, 13, 2, 3, 4]
    assert slots[:7] == [41, 42, 43, 44, 51, 52, 53]
    assert (rows[:2], seq_lens[:2], starts[:2], lens[:2]) == ([3, 5], [14, 5], [0, 4], [4, 3])
    assert lasts[:2] == [3, 6]  # each span's last token, where a draft reads its proposal
    # Five padding tokens, each one request of one token over the padding row and slot.
    assert ids[7:] == [0] * 5 and positions[7:] == [0] * 5 and slots[7:] == [PADDING_SLOT] * 5
    assert rows[2:7] == [9] * 5 and seq_lens[2:7] == [1] * 5 and lens[2:7] == [1] * 5
    assert starts[2:7] == [7, 8, 9, 10, 11]
    # The rest hold no token: attention skips them.
    assert lens[7:] == [0] * 5 and rows[7:] == [9] * 5
    # Every token belongs to exactly one request.
    covered = sorted(t for s, n in zip(starts, lens) for t in range(s, s + n))
    assert covered == list(range(12))
    with pytest.raises(AssertionError):
        padded_columns(6, spans, padding_row=9)


@pytest.mark.parametrize("num_requests,width,size", [(2, 4, 12), (3, 4, 12), (1, 1, 8), (5, 3, 16)])
def test_uniform_columns_equal_the_padded_columns_of_the_same_spans(num_requests, width, size):
    """A round's verify fills its graph from arrays: what it loads is what `padded_columns`
    builds from the same spans, padding included."""
    rng = np.random.default_rng(num_requests * 100 + width)
    rows = rng.integers(1, 50, num_requests)
    starts = rng.integers(0, 300, num_requests)
    tokens = rng.integers(0, 1000, (num_requests, width))
    slots = rng.integers(1, 5000, (num_requests, width))
    spans = [
        Span(int(r), int(s), t.tolist(), sl.tolist())
        for r, s, t, sl in zip(rows, starts, tokens, slots)
    ]
    expected = np.array(padded_columns(size, spans, padding_row=7))
    got = uniform_columns(size, rows, starts, tokens, slots, padding_row=7)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


def test_attention_backend_choice() -> None:
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="supported: auto, torch, triton"):
        resolve_attention_backend("flash", "cpu")


def test_graphs_only_on_a_gpu_and_never_while_dumping(tiny_model_path: Path, tmp_path) -> None:
    args = EngineArgs(model=str(tiny_model_path), device="cpu", kv_cache_tokens=256)
    assert resolve(args).engine_config.cuda_graph_max_bs == 0
    assert resolve(args).engine_config.attention_backend == "torch"
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1"):
        EngineArgs(model=str(tiny_model_path), cuda_graph_max_bs=0)
    if not triton_runs_on("cuda"):
        return
    gpu = dataclasses.replace(args, device="cuda", max_num_seqs=16)

    def max_bs(**changes) -> int:
        return resolve(dataclasses.replace(gpu, **changes)).engine_config.cuda_graph_max_bs

    assert max_bs() == 16
    assert max_bs(cuda_graph_max_bs=4) == 4
    assert max_bs(cuda_graph_max_bs=99) == 16
    assert max_bs(disable_cuda_graph=True) == 0
    assert max_bs(attention_backend="torch") == 0
    assert max_bs(debug_tensor_dump_dir=str(tmp_path / "dump")) == 0


def test_the_padding_row_is_never_handed_out() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    rows = [pool.allocate_row() for _ in range(3)]
    assert pool.padding_row not in rows and pool.req_to_token.shape[0] == 4
    with pytest.raises(MemoryError):
        pool.allocate_row()


def test_cli_takes_the_graph_and_backend_flags() -> None:
    import argparse

    from cluster.commands.cli_args import add_engine_args
    from cluster.commands.cli_commands import engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args(
        parser.parse_args(
            ["--attention-backend", "torch", "--disable-cuda-graph", "--cuda-graph-max-bs", "8"]
        )
    )
    assert (args.attention_backend, args.disable_cuda_graph, args.cuda_graph_max_bs) == (
        "torch",
        True,
        8,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1 to 40 tokens and answers of 1 to 40: with max_num_seqs below n, requests
    join as others leave, and the batch passes through many sizes and buckets."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


def _gpu_llm(path: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("max_num_seqs", 12)
    return LLM(str(path), device="cuda", dtype="float32", **kw)


@pytest.mark.parametrize("seed", [0, 1])
@needs_gpu
def test_graphs_give_the_eager_engines_tokens(tiny_model_path: Path, seed: int) -> None:
    prompts, params = _workload(30, seed)
    graphs = _gpu_llm(tiny_model_path)
    assert graphs.engine.runner.graphs is not None
    eager = _gpu_llm(tiny_model_path, disable_cuda_graph=True)
    assert eager.engine.runner.graphs is None
    reference = _gpu_llm(tiny_model_path, attention_backend="torch")
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert graphs.engine.runner.graphs.num_replays > 0
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    assert got == [o.token_ids for o in reference.generate(prompts, params)]


@needs_gpu
def test_padded_rows_write_only_the_padding_slot(tiny_model_path: Path) -> None:
    llm = _gpu_llm(tiny_model_path, max_num_seqs=8)
    runner = llm.engine.runner
    core = llm.engine
    for i in range(3):  # three requests: their decode batch is padded to the bucket of 4
        core.add_request(core.make_request(str(i), [5 + i, 6, 7], SamplingParams(max_tokens=4)))
    core.step()  # the prefill
    assert len(core.scheduler.running) == 3
    before = runner.kv_pool.kv_buffer.clone()
    batch = core.scheduler.schedule()
    forward_batch = runner.build_batch(batch.requests)
    assert forward_batch.graph_batch_size == 4
    runner.forward(forward_batch)
    changed = (runner.kv_pool.kv_buffer != before).flatten(1).any(dim=1).nonzero().flatten()
    written = {req.slots[req.kv_len] for req in batch.requests} | {0}
    assert set(changed.tolist()) <= written
    assert set(changed.tolist()) >= written - {0}
    assert (runner.req_to_token_pool.req_to_token[runner.req_to_token_pool.padding_row] == 0).all()


@needs_gpu
def test_a_poisoned_padding_slot_changes_no_output(tiny_model_path: Path) -> None:
    prompts, params = _workload(11, seed=3)
    llm = _gpu_llm(tiny_model_path)
    clean = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.kv_pool.kv_buffer[0] = float("nan")
    poisoned = [o.token_ids for o in llm.generate(prompts, params)]
    assert poisoned == clean


@needs_gpu
def test_speculation_on_the_triton_backend_is_lossless(tmp_path_factory) -> None:
    from tiny_drafts import make_random_draft
    from tiny_models import make_tiny_llama

    root = tmp_path_factory.mktemp("graph_spec")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "draft", root / "target", 3, seed=1)
    prompts, params = _workload(20, seed=5)
    plain = [o.token_ids for o in _gpu_llm(root / "target").generate(prompts, params)]
    shapes = [
        {"num_draft_chains": 1},
        {"num_draft_chains": 3},
        {"speculative_topk": 4, "num_draft_tokens": 10},
    ]
    for shape in shapes:
        spec = _gpu_llm(
            root / "target",
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(root / "draft"),
            **shape,
        )
        assert [o.token_ids for o in spec.generate(prompts, params)] == plain
        verify = spec.engine.runner.verify_graphs
        assert verify is not None and verify.num_replays > 0
        assert verify.trees == (shape != {"num_draft_chains": 1})
        # Every shape's decode steps extend through the fixed shape's graph (chains and trees
        # alike: spec.runtime.device_round, spec.runtime.tree_round).
        fixed = spec.engine.speculator.fixed_extend
        assert fixed.num_replays > 0
        # The decode step's extend was captured without autograd, as every other forward: with
        # it the kernels fall back to their unfused torch paths.
        assert fixed.graphs and all(
            out.is_inference() for _, _, outputs in fixed.graphs.values() for out in outputs
        )
