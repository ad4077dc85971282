"""The k most likely tokens of each row of logits and their softmax probabilities, in one
pass over the row: what each node of a draft token tree proposes (k from 2 to 16). Torch takes
a float32 copy, a softmax, a top-k and the draft vocabulary's lookup; its top-k over a few
rows of thousands of columns runs one block per row through several radix passes, about 50 us
on an H200 for a tree depth's rows, where this kernel reads each row once.

Each program reads one row in blocks. Per block it takes the block's k largest logits one at
a time (a max, then the first index holding it) and keeps each one that beats the worst of the
k kept so far; beside that it keeps per lane a running maximum and the sum of exp(x - maximum),
rescaled as the maximum grows, as engine/kernels/top1.py does. The kept ones are written largest
first; equal logits go lowest index first. A probability is exp(x - max) / sum in float32: the
order is the logits', which equals the probabilities' except where distinct logits round to
one probability. A NaN logit counts as -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.split_topk import split_topk_into
from engine.kernels.top1 import (
    running_sum,
    softmax_denominator,
    top1_with_probability,
    top_outputs,
)

MAX_K = 16
# Rows longer than this are split across programs (engine/kernels/split_topk.py):
# `python bench/proposal_kernels.py` on an H200 (docs/BENCHMARKS.md, "The whole vocabulary on
# a GPU").
SPLIT_ABOVE = 2048


@triton.jit
def _topk_kernel(
    logits_ptr,
    vocab_ptr,
    ids_ptr,
    probs_ptr,
    stride_row,
    size,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    slots = tl.arange(0, K_PAD)
    real_slot = slots < K
    # The kept logits and their indices; empty slots hold -inf at indices past the row, so
    # that any logit of the row beats them.
    kept = tl.full([K_PAD], float("-inf"), tl.float32)
    kept_index = size + slots
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, size, BLOCK):
        index = start + lanes
        valid = index < size
        x = tl.load(base + index, mask=valid, other=float("-inf")).to(tl.float32)
        # A NaN (a broken model) counts as -inf: every kept slot then still names a token.
        x = tl.where(x == x, x, float("-inf"))
        best, total = running_sum(best, total, x)
        alive = valid
        for _ in tl.static_range(K):
            top = tl.max(tl.where(alive, x, float("-inf")), axis=0)
            first = tl.min(tl.where(alive & (x == top), index, size), axis=0)
            alive = alive & (index != first)
            # The worst kept: the lowest logit, and of equal ones the highest index.
            worst = tl.min(tl.where(real_slot, kept, float("inf")), axis=0)
            worst_index = tl.max(tl.where(real_slot & (kept == worst), kept_index, -1), axis=0)
            beats = (first < size) & ((top > worst) | ((top == worst) & (first < worst_index)))
            replace = beats & (kept_index == worst_index) & real_slot
            kept = tl.where(replace, top, kept)
            kept_index = tl.where(replace, first, kept_index)
    row_max = tl.max(best, axis=0)
    denominator = softmax_denominator(best, total, row_max)
    out = row * K
    remaining = real_slot
    for j in tl.static_range(K):
        top = tl.max(tl.where(remaining, kept, float("-inf")), axis=0)
        first = tl.min(tl.where(remaining & (kept == top), kept_index, size + K_PAD), axis=0)
        remaining = remaining & (kept_index != first)
        token = first.to(tl.int64)
        if HAS_VOCAB:
            token = tl.load(vocab_ptr + first).to(tl.int64)
        tl.store(ids_ptr + out + j, token)
        tl.store(probs_ptr + out + j, tl.exp(top - row_max) / denominator)


def topk_with_probability(
    logits: torch.Tensor, k: int, vocab: torch.Tensor | None = None, split: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, rows contiguous), 1 <= k <= min(V, MAX_K) -> (each row's
    k most likely tokens [B, k] int64, largest first, mapped through `vocab` [V] when given;
    their softmax probabilities [B, k] float32). k = 1 takes top1's kernels. `split`: each row
    across many programs, or one program a row (None: split rows longer than SPLIT_ABOVE)."""
    size = logits.shape[1]
    assert 1 <= k <= min(size, MAX_K), f"k={k} for rows of {size} (at most {MAX_K})"
    if k == 1:
        return top1_with_probability(logits, vocab, split)
    ids, probs = top_outputs(logits, k)
    if not ids.shape[0]:
        return ids, probs
    if (size > SPLIT_ABOVE) if split is None else split:
        split_topk_into(logits, k, vocab, ids, probs)
    else:
        block = min(8192, triton.next_power_of_2(size))
        _topk_kernel[(ids.shape[0],)](
            logits,
            ids if vocab is None else vocab,
            ids,
            probs,
            logits.stride(0),
            size,
            K=k,
            K_PAD=triton.next_power_of_2(k),
            HAS_VOCAB=vocab is not None,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )
    return ids, probs
