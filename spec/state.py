"""Per-request speculative state: `DraftState`, what crosses from a prefill node to a decode
node, and `SpecRequestState`, what the engine keeps on `Request.spec_state`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec.draft_runner import DraftSeq
from spec.tree import DraftTree


@dataclass
class DraftState:
    """Everything a decode node needs, besides the KV, to go on speculating for a request that
    a prefill node ran. The KV: the target's for the prompt, and each depth's for positions
    [0, n-1] (`MultiLayerEagleWorker.depth_kv`). With it, the first decode step verifies this
    chain without a draft forward, and each depth d extends from its valid prefix max(0, n-d)."""

    num_prefilled: int  # n: prompt positions that the target and every depth ran over
    draft_token_ids: list[int]  # [K] the chain the first decode step verifies
    draft_probs: list[float]  # [K] the draft's probability of each (topk_p with topk = 1)
    # [spec_hidden_size] the target's hidden state at position n-1 (the metadata row's
    # hidden_states). The chain loop does not read it again: depth 0 starts at position n with
    # the hidden states of the first verify. It is there for drafts that re-draft at decode.
    target_hidden: torch.Tensor
    # [K-1, hidden_size] depth d's output at position n-d-1, computed from committed inputs:
    # depth d+1 reads it at the start of the first extend. Zeros where n-d-1 < 0.
    boundary_hidden: torch.Tensor


@dataclass
class SpecRequestState:
    seqs: list[DraftSeq]  # one per depth, each in that depth's own pools
    chain: list[int] = field(default_factory=list)  # [K] draft tokens for the next verify
    chain_probs: list[float] = field(default_factory=list)
    # The draft tree the next verify checks, when the engine drafts trees (spec/tree.py);
    # None: `chain` alone.
    tree: DraftTree | None = None
    # boundary[d] (d < K-1): depth d's output at position m-d-1 (m: the newest token's
    # position), None while m-d-1 < 0. Depth d+1's next extend starts there.
    boundary: list[torch.Tensor | None] = field(default_factory=list)
    target_hidden: torch.Tensor | None = None  # the target's at position m-1
