"""What a speculative verify forward hands back, and the greedy acceptance of uniform chains.

A verify of chains brings each request's newest token then its K drafts, K + 1 tokens a
request side by side. Greedy acceptance is then a comparison: the accepted count is the length
of the prefix where the drafts equal the target's argmax at the position before each. A CUDA
graph of such verifies computes it in the replay (`greedy_chain_verdicts`), where eagerly it
costs the host five calls into torch a round."""

from __future__ import annotations

from typing import NamedTuple

import torch


class VerifyOutputs(NamedTuple):
    logits: torch.Tensor  # [T, vocab] at every token
    hidden: torch.Tensor  # [T, spec_hidden_size]: the draft's input at every token
    # [n, K+2] per request: the target's argmax at its K+1 tokens, then its accepted count;
    # computed by a graph of chain verifies (None elsewhere; meaningful for uniform chains).
    verdicts: torch.Tensor | None = None


def greedy_chain_verdicts(
    logits: torch.Tensor, input_ids: torch.Tensor, width: int
) -> torch.Tensor:
    """[n, width + 1] for the first n = T // width spans of `width` tokens each (the newest
    token then width - 1 drafts): the argmax of `logits` [T, vocab] at each token, then how
    many leading drafts equal the argmax at the token before them."""
    n = logits.shape[0] // width
    used = n * width
    targets = logits[:used].argmax(dim=-1).view(n, width)
    drafts = input_ids[:used].view(n, width)[:, 1:]
    accepted = (targets[:, :-1] == drafts).long().cumprod(dim=1).sum(dim=1)
    return torch.cat([targets, accepted[:, None]], dim=1)
