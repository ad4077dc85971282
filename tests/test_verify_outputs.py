"""The verdicts a verify graph of chains computes in its replay (engine.sampling.verify_outputs), on
a GPU: spec.runtime.acceptance.chain_verdicts over that replay's logits and tokens (the function
itself against a brute-force rule: tests/test_spec_acceptance.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_drafts import make_random_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.kernels import triton_runs_on
from spec.runtime.acceptance import chain_verdicts


@pytest.mark.gpu
@pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
@pytest.mark.parametrize("n", [1, 3, 7])
@torch.inference_mode()
def test_a_verify_graph_gives_the_verdicts_of_its_own_logits(tmp_path: Path, n: int) -> None:
    """A uniform load of n chains into the verify graphs (padded to a bucket): the verdicts
    the replay computed are the function's over the replay's logits and tokens, sliced to n,
    with drafts made to accept 0 .. K of them."""
    make_tiny_llama(tmp_path / "t", seed=0)
    make_random_draft(tmp_path / "d", tmp_path / "t", 3, seed=1)
    llm = LLM(str(tmp_path / "t"), device="cuda", dtype="float32", max_num_seqs=8,
              kv_cache_tokens=4096, speculative_algorithm="multi-layer-eagle",
              draft_model=str(tmp_path / "d"), num_draft_steps=3)  # fmt: skip
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    runner, k = llm.engine.runner, 3
    width = k + 1
    # Each request its own row and slots (all free once the generate above is done): its
    # tokens attend to their own KV only, so a replay's targets are the next one's too.
    rows = np.arange(n, dtype=np.int64)
    starts = np.full(n, 8, dtype=np.int64)
    context = 8 + width
    table = np.arange(1, 1 + n * context, dtype=np.int64).reshape(n, context)
    runner.req_to_token_pool.req_to_token[:n, :context] = torch.from_numpy(table).cuda()
    slots = table[:, 8:]
    tokens = np.random.default_rng(n).integers(3, 200, size=(n, width))
    for j in range(k):  # request i takes the target's token at each of its first i % (K+1)
        batch = runner.uniform_graph_batch(rows, starts, tokens, slots)
        assert batch is not None and batch.graph is not None
        targets = runner.forward_every_token(batch).logits.argmax(dim=-1).view(n, width)
        for i in range(n):
            if j < i % width:
                tokens[i, j + 1] = int(targets[i, j])
    batch = runner.uniform_graph_batch(rows, starts, tokens, slots)
    outputs = runner.forward_every_token(batch)
    assert outputs.verdicts is not None and outputs.verdicts.shape == (n, width + 1)
    eager = chain_verdicts(outputs.logits, batch.input_ids, width)
    assert torch.equal(outputs.verdicts, eager)
    assert all(a >= i % width for i, a in enumerate(outputs.verdicts[:, k + 1].tolist()))
