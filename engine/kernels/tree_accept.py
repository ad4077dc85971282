"""A Triton kernel that decides a round of draft trees on the device in one launch
(spec.runtime.tree_round): a fast implementation of the acceptance rule
spec.runtime.acceptance.accept (the path, and the committed tokens, the target's argmax along it),
fused with the move of the accepted nodes' KV to the positions the request keeps. In torch the same
takes a few dozen small kernels, each a call into torch on the host, which a round of trees pays on
its critical path. tests/test_tree_accept_kernel.py holds it to `accept` on random trees."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_accept_kernel(
    targets_ptr,  # [n, count + 1] int64: the target's argmax at the root and each node
    nodes_ptr,  # [n, 3 * count] int64 or float64, rows `nodes_stride` apart: tokens,
    # parents (-1: the root), levels
    nodes_stride,
    rows_ptr,  # [n] each request's row in the table
    newest_ptr,  # [n] each request's position m (the root's)
    table_ptr,  # the request table [max_reqs + 1, context]
    table_stride,
    kv_ptr,  # the KV pool, slot-major: [slots, row_size]
    row_size,
    out_ptr,  # [n, 2K + 3] int64: the path (K+1), the committed tokens (K+1), the accepted count
    count,
    k,
    NODES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = tl.arange(0, NODES)  # node index
    mask = cols < count
    nodes = nodes_ptr + i * nodes_stride + cols
    tokens = tl.load(nodes, mask=mask, other=-1).to(tl.int64)
    parents = tl.load(nodes + count, mask=mask, other=-1).to(tl.int64)
    levels = tl.load(nodes + 2 * count, mask=mask, other=0).to(tl.int64)
    targets = targets_ptr + i * (count + 1)
    match = mask & (tokens == tl.load(targets + parents + 1, mask=mask, other=-1))
    # Level by level: the first node (in node order) that matches and whose parent (the root,
    # or the node accepted at the level above) is accepted. Bit c of `accepted`: node c.
    one = tl.full((NODES,), 1, tl.int64)
    accepted = tl.zeros((), tl.int64)
    for level in range(1, k + 1):
        parent_in = (parents < 0) | (((accepted >> tl.maximum(parents, 0)) & 1) != 0)
        now = match & (levels == level) & parent_in
        first = tl.min(tl.where(now, cols, NODES), axis=0)
        accepted |= tl.sum(tl.where(cols == first, one << cols, 0), axis=0)
    kept = mask & (((accepted >> cols) & 1) != 0)
    num_accepted = tl.sum(kept.to(tl.int64), axis=0)
    row = tl.load(rows_ptr + i)
    m = tl.load(newest_ptr + i)
    table = table_ptr + row * table_stride
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = offsets < row_size
    out = out_ptr + i * (2 * k + 3)
    if chunk == 0:
        tl.store(out, 0)  # position 0: the root
        tl.store(out + k + 1, tl.load(targets))
    # Positions 1..K in order: the accepted node of level j moves from cache position m + its
    # span row to m + j. A node's span row is never below its level, so a move never
    # overwrites a node that a later level still reads.
    for level in range(1, k + 1):
        # At most one node a level is accepted (the first that matches).
        span_row = tl.sum(tl.where(kept & (levels == level), cols + 1, 0), axis=0)
        if chunk == 0:
            tl.store(out + level, span_row.to(tl.int64))
            tl.store(out + k + 1 + level, tl.load(targets + span_row))
        if level <= num_accepted:
            source = tl.load(table + m + span_row)
            target = tl.load(table + m + level)
            values = tl.load(kv_ptr + source * row_size + offsets, mask=in_row)
            tl.store(kv_ptr + target * row_size + offsets, values, mask=in_row)
    if chunk == 0:
        tl.store(out + 2 * k + 2, num_accepted)


# Elements of a KV slot's row each program moves.
_CHUNK = 2048


def accept_trees(
    targets: torch.Tensor,
    nodes: torch.Tensor,
    rows: torch.Tensor,
    newest: torch.Tensor,
    table: torch.Tensor,
    kv_buffer: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """targets [n, count + 1] (the argmax at the root and each node), `nodes` [n, 3 * count]
    (tokens, parents, levels; int64, or float64 as the extend's block holds them, each row
    contiguous), each request's table row and newest position m: [n, 2K + 3],
    per request the path (the span row of each level's accepted node: 0 for the root and past
    the accepted ones), then the verdicts: the K+1 committed candidates (the argmax at each
    row of the path) and the accepted count. The accepted nodes' KV in `kv_buffer`
    (slot-major) moves from m + their span row to m + their level."""
    n, width = targets.shape
    count = width - 1
    assert nodes.shape == (n, 3 * count) and nodes.stride(1) == 1 and targets.is_contiguous()
    assert nodes.dtype in (torch.int64, torch.float64)
    assert table.stride(1) == 1 and kv_buffer.is_contiguous()
    row_size = kv_buffer[0].numel()
    out = torch.empty((n, 2 * k + 3), dtype=torch.int64, device=targets.device)
    grid = (n, triton.cdiv(row_size, _CHUNK))
    _tree_accept_kernel[grid](
        targets,
        nodes,
        nodes.stride(0),
        rows,
        newest,
        table,
        table.stride(0),
        kv_buffer,
        row_size,
        out,
        count,
        k,
        NODES=triton.next_power_of_2(max(count, 2)),
        CHUNK=_CHUNK,
    )
    return out
