"""A Triton matrix-vector product for linear layers that see one row: a batch-1 decode step
reads every weight once for a single token, so its GEMMs are bound by how fast the weights
stream from memory. On an H100, cuBLAS's kernels for Llama-3-8B's shapes read 2.2 to 2.9 TB/s
(two of them split in K, with a reduce kernel each); this one 2.6 to 3.2, which takes half a
millisecond off such a step (docs/BENCHMARKS.md, GPU decode step).

Each program reduces BLOCK_N rows of the weight over the whole of K, BLOCK_K columns at a time,
in float32, so no second pass is needed; the product is rounded once to the output dtype, like
cuBLAS's, but the order of the float32 sums differs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Weights of at least this many elements count as large: their programs take fewer rows and
# more warps and stages, to keep more bytes in flight per program.
_LARGE = 1 << 26


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k + cols)
        w = tl.load(w_ptrs + k, mask=row_mask[:, None], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_mask)


def block_k(k: int) -> int | None:
    """The columns a program reads at a time for an inner size `k`; None where none divides."""
    return next((size for size in (2048, 1024, 512) if k % size == 0), None)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] (both contiguous, one dtype, K a multiple of
    512): x @ weight.T, [..., N]."""
    n, k = weight.shape
    tile = block_k(k)
    assert tile is not None and x.numel() == k, "one row, K a multiple of 512"
    rows, warps, stages = (2, 8, 3) if n * k >= _LARGE else (4, 4, 1)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, rows),)](
        x, weight, y, n, k, BLOCK_N=rows, BLOCK_K=tile, num_warps=warps, num_stages=stages
    )
    return y
