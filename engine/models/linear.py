"""The decoder's linear layer: nn.Linear, with a Triton matrix-vector product for one row of a
large weight on a GPU (engine.kernels.gemv), where cuBLAS leaves memory bandwidth unused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import triton_usable

# Smaller weights are read in a few microseconds either way; launch costs dominate there.
GEMV_MIN_ELEMENTS = 1 << 24


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    k = weight.shape[-1]
    return (
        x.shape[-1] == k
        and x.numel() == k
        and weight.numel() >= GEMV_MIN_ELEMENTS
        and k % 512 == 0
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.is_contiguous()
        and weight.is_contiguous()
        and triton_usable(x)
    )


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv_applies(x, self.weight):
            from engine.kernels.gemv import gemv

            out = gemv(x, self.weight)
            # A bias (Qwen2's q, k and v) is added after the product: one more small kernel,
            # and one more rounding than cuBLAS's bias epilogue.
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)
