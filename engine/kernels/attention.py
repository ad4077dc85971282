"""Paged attention as one Triton kernel for decode and every kind of extend (prompt chunks,
speculative verify, draft extends, alternative chains).

Every new token's K and V are in the cache before this runs (the rotary kernel writes them),
so a query at position p of request b attends to the cached positions 0..p of b's row in the
request table, whatever part of them this forward computed (of a token tree's span, only the
positions its bitmask names). One program takes one request, a block of its new tokens and one
KV head, with the G query heads that share that KV head: the (token, head) pairs are the rows
of one tile, so K and V are read once per block of tokens and never once per query head.
Metadata is four device tensors per request (row, length after this forward, first new token
in the flat batch, number of new tokens): a CUDA graph replays the kernel over new values in
the same buffers.

Decode of one long sequence can also split the cached positions over several programs (flash
decoding), each writing a partial result and its log-sum-exp, merged by a second kernel: with
few requests and few KV heads the one-pass kernel would leave most of the GPU idle.

A sliding-window layer passes its window W and the queries' rotary positions: a query at
position p sees only the cached positions above p - W, and a program reads no key below the
window of its block's first query."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of the query tile (new tokens x query heads of one KV head); tl.dot needs 16 or more.
_MIN_ROWS = 16
_MAX_ROWS = 64
_BLOCK_N = 64


@triton.jit
def _attention_kernel(
    q_ptr,
    out_ptr,
    lse_ptr,
    k_cache_ptr,
    v_cache_ptr,
    req_to_token_ptr,
    rows_ptr,
    seq_lens_ptr,
    q_starts_ptr,
    q_lens_ptr,
    tree_bits_ptr,
    positions_ptr,
    stride_q_token,
    stride_q_head,
    stride_out_split,
    stride_out_token,
    stride_out_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_table,
    stride_lse_split,
    stride_lse_token,
    scale,
    num_splits,
    window,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Blocks of new tokens on the first grid axis, whose size CUDA does not cap at 65,535.
    block = tl.program_id(0)
    request = tl.program_id(1)
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    q_len = tl.load(q_lens_ptr + request)
    if block * BLOCK_TOKENS >= q_len:
        return
    split = tl.program_id(2) // NUM_KV_HEADS
    seq_len = tl.load(seq_lens_ptr + request)
    q_start = tl.load(q_starts_ptr + request)
    row = tl.load(rows_ptr + request).to(tl.int64)
    prefix = seq_len - q_len

    tile = tl.arange(0, BLOCK_TOKENS * BLOCK_GROUP)
    token = block * BLOCK_TOKENS + tile // BLOCK_GROUP
    group = tile % BLOCK_GROUP
    valid = (token < q_len) & (group < GROUP)
    head = kv_head * GROUP + group
    # A padding row repeats the last real token, so that it sees at least one key.
    position = prefix + tl.minimum(token, q_len - 1)
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < DIM
    flat = (q_start + tl.minimum(token, q_len - 1)).to(tl.int64)
    q = tl.load(
        q_ptr + flat[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=valid[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if HAS_TREE:
        bits = tl.load(tree_bits_ptr + flat)

    # Keys this program reads: its split of those the block's queries may see, from the
    # window of its first query (a tree's queries all sit at the span's first position or
    # after it) to what its last query sees.
    end = tl.minimum(seq_len, prefix + (block + 1) * BLOCK_TOKENS)
    begin = 0
    if HAS_WINDOW:
        rotary = tl.load(positions_ptr + flat)
        if HAS_TREE:
            begin = tl.maximum(prefix - window + 1, 0)
        else:
            begin = tl.maximum(prefix + block * BLOCK_TOKENS - window + 1, 0)
    split_len = tl.cdiv(tl.cdiv(end - begin, num_splits), BLOCK_N) * BLOCK_N
    first = begin + split * split_len
    last = tl.minimum(end, first + split_len)
    m_i = tl.full([BLOCK_TOKENS * BLOCK_GROUP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_TOKENS * BLOCK_GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_TOKENS * BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < last
        slots = tl.load(req_to_token_ptr + row * stride_table + keys, mask=key_mask, other=0)
        slots = slots.to(tl.int64)
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_k_slot + kv_head * stride_k_head + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = (keys[None, :] <= position[:, None]) & key_mask[None, :]
        if HAS_TREE:
            # Offsets past bit 62 belong to spans without a tree, whose bits are all set.
            offsets = (keys - prefix).to(tl.int64)
            shifts = tl.minimum(tl.maximum(offsets, 0), 62)
            in_span = ((bits[:, None] >> shifts[None, :]) & 1) != 0
            visible = visible & ((offsets[None, :] < 0) | in_span)
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > rotary[:, None] - window)
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows that see no key of this block yet keep m = -inf; exp against 0 keeps them 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_v_slot + kv_head * stride_v_head + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_token = (q_start + token).to(tl.int64)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = (
        out_ptr
        + split * stride_out_split
        + out_token[:, None] * stride_out_token
        + head[:, None] * stride_out_head
        + dims[None, :]
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dim_mask[None, :])
    if WRITE_LSE:
        # Log-sum-exp of this split's scores; -inf where it saw no key.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        lse_ptrs = lse_ptr + split * stride_lse_split + out_token * stride_lse_token + head
        tl.store(lse_ptrs, lse, mask=valid)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_partial_split,
    stride_lse_split,
    stride_out_row,
    DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """Row r (a token and head) of the output from its splits' partial results and LSEs."""
    r = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_DIM)
    mask = dims < DIM
    m = tl.load(lse_ptr + r)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(lse_ptr + s * stride_lse_split + r))
    total = tl.zeros([BLOCK_DIM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_DIM], dtype=tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + s * stride_lse_split + r)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
        part = tl.load(
            partial_ptr + s * stride_partial_split + r * DIM + dims, mask=mask, other=0.0
        )
        acc += w * part
        total += w
    out = (acc / total).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * stride_out_row + dims, out, mask=mask)


def tile_tokens(max_q_len: int, group: int) -> int:
    """New tokens per program: enough rows for tl.dot, no more than the longest span needs."""
    block_group = triton.next_power_of_2(group)
    least = max(1, _MIN_ROWS // block_group)
    most = max(1, _MAX_ROWS // block_group)
    return max(least, min(most, triton.next_power_of_2(max(1, max_q_len))))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] of the new tokens -> attention output [T, H, D].

        k_cache, v_cache: [slots, Hkv, D] views of one layer; req_to_token [rows, max_len];
        per request (all [B] device tensors): its row, its length after this forward, its first
        token in q, its number of new tokens; `max_q_len` bounds the last (a launch size, so a CUDA
        graph captures it). `num_splits` > 1 splits each request's keys in that many parts, for
        decode of few long sequences. Every token of q must belong to one request (padding
    included): with splits, the merge writes every row. `tree_bits` [T] int64
    (ForwardBatch.tree_bits): each token's bitmask over its span's tokens, for token
    trees. `window` (a sliding-window layer's; None: full attention) with `positions` [T]
    int64, each token's rotary position (ForwardBatch.positions): a query at position p sees
    only the cached positions above p - window."""
    assert (window is None) == (positions is None), "a window needs the queries' positions"
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    batch = rows.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    block_tokens = tile_tokens(max_q_len, group)
    ieee = q.dtype == torch.float32
    if num_splits == 1:
        partial, lse = out, out  # no LSE is written
        stride_split = stride_lse_split = stride_lse_token = 0
    else:
        partial = torch.empty(
            (num_splits, num_tokens, num_heads, dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        stride_split = partial.stride(0)
        stride_lse_split, stride_lse_token = lse.stride(0), lse.stride(1)
    grid = (triton.cdiv(max_q_len, block_tokens), batch, num_kv_heads * num_splits)
    _attention_kernel[grid](
        q,
        partial,
        lse,
        k_cache,
        v_cache,
        req_to_token,
        rows,
        seq_lens,
        q_starts,
        q_lens,
        # Never read without a tree: any pointer stands in.
        q_lens if tree_bits is None else tree_bits,
        q_lens if positions is None else positions,
        q.stride(0),
        q.stride(1),
        stride_split,
        partial.stride(-3),
        partial.stride(-2),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        stride_lse_split,
        stride_lse_token,
        scale,
        num_splits,
        0 if window is None else window,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        DIM=dim,
        BLOCK_DIM=triton.next_power_of_2(dim),
        BLOCK_TOKENS=block_tokens,
        BLOCK_GROUP=triton.next_power_of_2(group),
        BLOCK_N=_BLOCK_N,
        IEEE=ieee,
        WRITE_LSE=num_splits > 1,
        HAS_TREE=tree_bits is not None,
        HAS_WINDOW=window is not None,
        num_warps=4,
    )
    if num_splits > 1:
        rows_out = out.view(num_tokens * num_heads, dim)
        _merge_splits_kernel[(num_tokens * num_heads,)](
            partial,
            lse,
            rows_out,
            num_splits,
            partial.stride(0),
            lse.stride(0),
            rows_out.stride(0),
            DIM=dim,
            BLOCK_DIM=triton.next_power_of_2(dim),
            num_warps=1,
        )
    return out
