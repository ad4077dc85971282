"""A decoder layer's closing residual add is deferred into the next layer's first norm (one
kernel a layer fewer on a GPU). The sums it forms are those of adding at each layer's end, bit
for bit: the same logits' inputs with the layers run one by one (as when a tensor dump hooks
them), on the CPU in float32 and on a GPU in bfloat16 with the Triton kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import triton_runs_on

DEVICES = [
    ("cpu", "float32"),
    pytest.param(
        ("cuda", "bfloat16"),
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton"),
        ],
    ),
]


@pytest.mark.parametrize("device_dtype", DEVICES)
def test_deferred_adds_equal_adding_at_each_layer(tiny_model_path: Path, device_dtype) -> None:
    device, dtype = device_dtype
    # No prefix cache: the second pass computes every token again, as the first did.
    llm = LLM(str(tiny_model_path), device=device, dtype=dtype, max_num_seqs=4,
              kv_cache_tokens=2048, disable_cuda_graph=True,
              enable_prefix_cache=False)  # fmt: skip
    model = llm.engine.runner.model
    finals: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda module, args: finals.append(args[0].clone()))
    prompts = [[5 + (7 * i + j) % 250 for j in range(9 + 13 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    deferred = [o.token_ids for o in llm.generate(prompts, params)]
    deferred_finals, finals[:] = list(finals), []
    for layer in model.model.layers:  # observed layers run one by one
        layer.register_forward_hook(lambda module, args, output: None)
    one_by_one = [o.token_ids for o in llm.generate(prompts, params)]
    assert deferred == one_by_one
    assert deferred_finals and len(deferred_finals) == len(finals)
    assert all(torch.equal(a, b) for a, b in zip(deferred_finals, finals))
