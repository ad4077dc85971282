"""A Triton kernel that moves a graph's uniform spans on past each request's kept tokens, in
one launch (engine.cuda_graph.CudaGraphs.advance_uniform): in torch it takes about a dozen
small kernels, each a call into torch on the host, which a speculative round pays on its
critical path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_kernel(
    inputs_ptr,  # [rows, capacity] int64: ids, positions, slots, then per request row, length
    capacity,
    kept_ptr,  # [n] (stride kept_stride)
    kept_stride,
    candidates_ptr,  # [n, width] (row stride candidates_stride)
    candidates_stride,
    rest_ptr,  # [n, width - 1] (row stride rest_stride)
    rest_stride,
    table_ptr,  # the request table [max_reqs + 1, context]
    table_stride,
    width,
    ROWS_ROW: tl.constexpr,
    SEQ_LENS_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    first = i * width
    kept = tl.load(kept_ptr + i * kept_stride).to(tl.int64)
    start = tl.load(inputs_ptr + capacity + first) + kept + 1  # the moved span's first position
    positions = start + cols
    row = tl.load(inputs_ptr + ROWS_ROW * capacity + i)
    slots = tl.load(table_ptr + row * table_stride + positions, mask=mask, other=0)
    head = tl.load(candidates_ptr + i * candidates_stride + kept).to(tl.int64)
    rest_mask = mask & (cols > 0)
    rest = tl.load(rest_ptr + i * rest_stride + cols - 1, mask=rest_mask, other=0).to(tl.int64)
    tokens = tl.where(cols == 0, head, rest)
    tl.store(inputs_ptr + first + cols, tokens, mask=mask)
    tl.store(inputs_ptr + capacity + first + cols, positions, mask=mask)
    tl.store(inputs_ptr + 2 * capacity + first + cols, slots.to(tl.int64), mask=mask)
    tl.store(inputs_ptr + SEQ_LENS_ROW * capacity + i, start + width)


def advance_spans(
    inputs: torch.Tensor,
    kept: torch.Tensor,
    candidates: torch.Tensor,
    rest: torch.Tensor,
    table: torch.Tensor,
    rows_row: int,
    seq_lens_row: int,
) -> None:
    """`inputs` [rows, capacity] (int64; rows 0-2 per token: id, position, slot; row
    `rows_row` each request's table row, `seq_lens_row` its length), its first n spans of
    `width` tokens each: span i moves kept[i] + 1 positions on and brings candidates[i,
    kept[i]] then rest[i] ([n, width - 1]), its slots read from `table` [*, context]."""
    n, width = candidates.shape
    assert inputs.dtype == torch.int64 and inputs.is_contiguous()
    assert candidates.stride(1) == 1 and rest.stride(1) == 1 and table.stride(1) == 1
    _advance_kernel[(n,)](
        inputs,
        inputs.shape[1],
        kept,
        kept.stride(0),
        candidates,
        candidates.stride(0),
        rest,
        rest.stride(0),
        table,
        table.stride(0),
        width,
        ROWS_ROW=rows_row,
        SEQ_LENS_ROW=seq_lens_row,
        BLOCK=triton.next_power_of_2(width),
    )
