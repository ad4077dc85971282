"""The k most likely tokens of each row of logits and their softmax probabilities, with each row
split across many programs: what a draft depth proposes when its rows are long.

A kernel that gives each row one program runs as many programs as there are rows; a draft depth
at batch 1 has one to eight rows, so a few of the GPU's 132 multiprocessors walk a 49,152-token
row block by block while the rest idle (about 70 us a depth for the top 8 on an H200). Here a
first kernel gives each CHUNK of a row its own program, which keeps the chunk's k largest logits
(largest first, equal ones lowest index first), its maximum and its sum of exp(x - maximum); a
second kernel, one program a row, merges the chunks' candidates and sums. The order is the
one-program kernels' (engine/kernels/top1.py, topk.py): largest first, equal logits lowest index
first. A probability is exp(x - max) / sum in float32, as theirs. A NaN logit counts as -inf, as in
topk.py (top1.py's kernel gives such a row a NaN probability), and each of n +inf logits has
probability 1 / n (theirs give NaN, or 1 for a single one in top1.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048
# Past the last index of any row: a slot that holds no token loses every tie to one that does.
NO_INDEX = 2**31 - 1


@triton.jit
def _chunk_kernel(
    logits_ptr,
    top_ptr,
    index_ptr,
    max_ptr,
    sum_ptr,
    stride_row,
    size,
    chunks,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    NO_INDEX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = index < size
    x = tl.load(logits_ptr + row * stride_row + index, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))
    top = tl.max(x, axis=0)
    # exp of (-inf) - (-inf) and of inf - inf is NaN: the maximum itself and -inf are spelled out.
    term = tl.where(x == top, 1.0, tl.exp(x - top))
    term = tl.where(x == float("-inf"), 0.0, term)
    slot = row * chunks + chunk
    tl.store(max_ptr + slot, top)
    tl.store(sum_ptr + slot, tl.sum(term, axis=0))
    alive = valid
    for j in tl.static_range(K):
        best = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        first = tl.min(tl.where(alive & (x == best), index, NO_INDEX), axis=0)
        alive = alive & (index != first)
        tl.store(top_ptr + slot * K_PAD + j, best)
        tl.store(index_ptr + slot * K_PAD + j, first)


@triton.jit
def _merge_kernel(
    top_ptr,
    index_ptr,
    max_ptr,
    sum_ptr,
    vocab_ptr,
    ids_ptr,
    probs_ptr,
    chunks,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    CANDIDATES: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    HAS_VOCAB: tl.constexpr,
    NO_INDEX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Each chunk wrote K of its K_PAD slots.
    candidate = tl.arange(0, CANDIDATES)
    real = (candidate < chunks * K_PAD) & (candidate % K_PAD < K)
    base = row * chunks * K_PAD
    value = tl.load(top_ptr + base + candidate, mask=real, other=float("-inf"))
    index = tl.load(index_ptr + base + candidate, mask=real, other=NO_INDEX)
    part = tl.arange(0, CHUNKS_PAD)
    in_row = part < chunks
    maxima = tl.load(max_ptr + row * chunks + part, mask=in_row, other=float("-inf"))
    sums = tl.load(sum_ptr + row * chunks + part, mask=in_row, other=0.0)
    row_max = tl.max(maxima, axis=0)
    weights = tl.where(maxima == row_max, 1.0, tl.exp(maxima - row_max))
    weights = tl.where(maxima == float("-inf"), 0.0, weights)
    denominator = tl.sum(sums * weights, axis=0)
    alive = real
    for j in tl.static_range(K):
        best = tl.max(tl.where(alive, value, float("-inf")), axis=0)
        first = tl.min(tl.where(alive & (value == best), index, NO_INDEX), axis=0)
        alive = alive & (index != first)
        token = first.to(tl.int64)
        if HAS_VOCAB:
            token = tl.load(vocab_ptr + first).to(tl.int64)
        tl.store(ids_ptr + row * K + j, token)
        # inf - inf is NaN: a +inf logit's share is spelled out.
        share = tl.where(best == row_max, 1.0, tl.exp(best - row_max))
        tl.store(probs_ptr + row * K + j, share / denominator)


def split_topk_into(
    logits: torch.Tensor,
    k: int,
    vocab: torch.Tensor | None,
    ids: torch.Tensor,
    probs: torch.Tensor,
) -> None:
    """Write each row's k most likely tokens of logits [B, V] into ids [B, k] int64 (through
    `vocab` when given) and their probabilities into probs [B, k] float32, largest first."""
    rows, size = logits.shape
    chunks = triton.cdiv(size, CHUNK)
    k_pad = triton.next_power_of_2(k)
    device = logits.device
    top = torch.empty((rows, chunks, k_pad), dtype=torch.float32, device=device)
    index = torch.empty((rows, chunks, k_pad), dtype=torch.int32, device=device)
    maxima = torch.empty((rows, chunks), dtype=torch.float32, device=device)
    sums = torch.empty((rows, chunks), dtype=torch.float32, device=device)
    _chunk_kernel[(rows, chunks)](
        logits, top, index, maxima, sums, logits.stride(0), size, chunks,
        K=k, K_PAD=k_pad, CHUNK=CHUNK, NO_INDEX=NO_INDEX, num_warps=4,
    )  # fmt: skip
    _merge_kernel[(rows,)](
        top, index, maxima, sums, ids if vocab is None else vocab, ids, probs, chunks,
        K=k, K_PAD=k_pad, CANDIDATES=triton.next_power_of_2(chunks * k_pad),
        CHUNKS_PAD=triton.next_power_of_2(chunks), HAS_VOCAB=vocab is not None,
        NO_INDEX=NO_INDEX, num_warps=4,
    )  # fmt: skip
