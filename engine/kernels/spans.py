"""A Triton kernel that moves a graph's uniform spans on past each request's kept tokens, in
one launch (engine.executor.cuda_graph.CudaGraphs.advance_uniform): in torch it takes about a dozen
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


@triton.jit
def _advance_tree_kernel(
    inputs_ptr,  # [rows, capacity] int64, as _advance_kernel's, then each token's tree mask
    capacity,
    kept_ptr,  # [n] (stride kept_stride)
    kept_stride,
    candidates_ptr,  # [n, K+1] (row stride candidates_stride)
    candidates_stride,
    nodes_ptr,  # [n, 3 * count]: tokens, parents (-1: the root), levels; any number type
    nodes_stride,
    table_ptr,
    table_stride,
    count,
    depth,
    ROWS_ROW: tl.constexpr,
    SEQ_LENS_ROW: tl.constexpr,
    BITS_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # span rows: the root, then node cols - 1
    width = count + 1
    mask = cols < width
    node_mask = mask & (cols > 0)
    first = i * width
    kept = tl.load(kept_ptr + i * kept_stride).to(tl.int64)
    start = tl.load(inputs_ptr + capacity + first) + kept + 1  # the moved root's position
    row = tl.load(inputs_ptr + ROWS_ROW * capacity + i)
    slots = tl.load(table_ptr + row * table_stride + start + cols, mask=mask, other=0)
    nodes = nodes_ptr + i * nodes_stride + cols - 1
    head = tl.load(candidates_ptr + i * candidates_stride + kept).to(tl.int64)
    tokens = tl.load(nodes, mask=node_mask, other=0).to(tl.int64)
    parent = tl.load(nodes + count, mask=node_mask, other=-1).to(tl.int64)
    level = tl.load(nodes + 2 * count, mask=node_mask, other=0).to(tl.int64)
    # Each row sees itself, the root and its ancestors: walk up from its parent.
    one = tl.full((BLOCK,), 1, tl.int64)
    bits = (one << cols) | 1
    for _ in range(depth):
        up = parent >= 0
        bits |= tl.where(up, one << (parent + 1), 0)
        parent = tl.load(nodes_ptr + i * nodes_stride + count + parent, mask=up, other=-1)
        parent = parent.to(tl.int64)
    tl.store(inputs_ptr + first + cols, tl.where(cols == 0, head, tokens), mask=mask)
    tl.store(inputs_ptr + capacity + first + cols, start + level, mask=mask)
    tl.store(inputs_ptr + 2 * capacity + first + cols, slots.to(tl.int64), mask=mask)
    tl.store(inputs_ptr + BITS_ROW * capacity + first + cols, bits, mask=mask)
    tl.store(inputs_ptr + SEQ_LENS_ROW * capacity + i, start + width)


def advance_tree_spans(
    inputs: torch.Tensor,
    kept: torch.Tensor,
    candidates: torch.Tensor,
    nodes: torch.Tensor,
    depth: int,
    table: torch.Tensor,
    rows_row: int,
    seq_lens_row: int,
    bits_row: int,
) -> None:
    """`advance_spans` for spans of token trees: span i's root moves kept[i] + 1 positions on
    and brings candidates[i, kept[i]], its nodes those of `nodes` [n, 3 * count] (tokens,
    parents, levels; in any number type), each at the root's position plus its level, in the
    cache positions after the root; row `bits_row` gets each row's visibility mask (itself,
    the root and its ancestors, at most `depth` levels above it)."""
    n = candidates.shape[0]
    count = nodes.shape[1] // 3
    assert inputs.dtype == torch.int64 and inputs.is_contiguous()
    assert candidates.stride(1) == 1 and nodes.stride(1) == 1 and table.stride(1) == 1
    _advance_tree_kernel[(n,)](
        inputs,
        inputs.shape[1],
        kept,
        kept.stride(0),
        candidates,
        candidates.stride(0),
        nodes,
        nodes.stride(0),
        table,
        table.stride(0),
        count,
        depth,
        ROWS_ROW=rows_row,
        SEQ_LENS_ROW=seq_lens_row,
        BITS_ROW=bits_row,
        BLOCK=triton.next_power_of_2(count + 1),
    )
