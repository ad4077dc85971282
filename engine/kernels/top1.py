"""The most likely token of each row of logits and its softmax probability, in one pass over
the row: what a draft depth proposes. Torch takes four kernels for it (the logits to float32,
a softmax, a max, the draft vocabulary's lookup); a draft extend runs it once per depth, where
each kernel costs a few microseconds whatever its size.

Each program reads one row in blocks, keeping per lane the running maximum, the first index
that reached it and the sum of exp(x - maximum) rescaled as the maximum grows; the lanes are
merged at the end. The probability of the maximum is 1 / sum, as softmax's is, with the sum
taken in another order (float32 throughout). Ties go to the lowest index, as torch's max on
the probabilities (where distinct logits round to one probability, torch's can differ). A
row of NaN or infinite logits (a broken model) gives a token and a probability that mean
nothing, as torch's do. Rows longer than SPLIT_ABOVE go to engine/kernels/split_topk.py, which
counts a NaN as -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.split_topk import split_topk_into

# Rows longer than this are split across programs: `python bench/proposal_kernels.py` on an
# H200 (docs/BENCHMARKS.md, "The whole vocabulary on a GPU").
SPLIT_ABOVE = 4096


@triton.jit
def running_sum(best, total, x):
    """Block `x` added to each lane's running maximum `best` and sum `total` of
    exp(logit - maximum), the sum rescaled as the maximum grows."""
    grown = tl.maximum(best, x)
    # exp of (-inf) - (-inf) is NaN: unchanged maxima and masked lanes are spelled out.
    scale = tl.where(best == grown, 1.0, tl.exp(best - grown))
    term = tl.where(x == grown, 1.0, tl.exp(x - grown))
    term = tl.where(x == float("-inf"), 0.0, term)
    return grown, total * scale + term


@triton.jit
def softmax_denominator(best, total, top):
    """The row's sum of exp(logit - top) from the lanes' `running_sum`s; `top` the row max."""
    weights = tl.where(best == top, 1.0, tl.exp(best - top))
    weights = tl.where(best == float("-inf"), 0.0, weights)
    return tl.sum(total * weights, axis=0)


@triton.jit
def _top1_kernel(
    logits_ptr,
    vocab_ptr,
    ids_ptr,
    probs_ptr,
    stride_row,
    size,
    HAS_VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, size, BLOCK):
        index = start + lanes
        x = tl.load(base + index, mask=index < size, other=float("-inf")).to(tl.float32)
        # Strictly greater: a lane keeps the first index of its maximum.
        best_index = tl.where(x > best, index, best_index)
        best, total = running_sum(best, total, x)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_index, size), axis=0)
    denominator = softmax_denominator(best, total, top)
    token = first.to(tl.int64)
    if HAS_VOCAB:
        token = tl.load(vocab_ptr + first).to(tl.int64)
    tl.store(ids_ptr + row, token)
    tl.store(probs_ptr + row, 1.0 / denominator)


def top1_with_probability(
    logits: torch.Tensor, vocab: torch.Tensor | None = None, split: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, rows contiguous) -> (each row's most likely token [B, 1]
    int64, mapped through `vocab` [V] when given; its softmax probability [B, 1] float32).
    `split`: each row across many programs (engine/kernels/split_topk.py), or one program a
    row (None: split rows longer than SPLIT_ABOVE)."""
    ids, probs = top_outputs(logits, 1)
    if not ids.shape[0]:
        return ids, probs
    if (logits.shape[1] > SPLIT_ABOVE) if split is None else split:
        split_topk_into(logits, 1, vocab, ids, probs)
    else:
        block = min(4096, triton.next_power_of_2(logits.shape[1]))
        _top1_kernel[(ids.shape[0],)](
            logits,
            ids if vocab is None else vocab,
            ids,
            probs,
            logits.stride(0),
            logits.shape[1],
            HAS_VOCAB=vocab is not None,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )
    return ids, probs


def top_outputs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids [B, k] int64 and probabilities [B, k] float32 a proposal kernel writes, for
    logits [B, V] whose rows are contiguous."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    rows = logits.shape[0]
    ids = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    probs = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    return ids, probs
