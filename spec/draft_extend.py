"""One request's way through a draft extend: which tokens and hidden states each depth reads,
and what it keeps. The alignment rules live here and nowhere else.

Depth d at position i reads token x_{i+d+1} and g^{d-1}_i (g^{-1}: the target's hidden state)
and predicts x_{i+d+2}. With committed tokens x_0..x_m, depth d runs over [valid_d, m-1]; the
tokens it reads past x_m are the new chain's drafts (depth d at m-1 reads draft d and proposes
draft d+1). Afterwards valid_d = max(0, m-d), and depth d keeps its output at m-d-1 as the
boundary: depth d+1's next extend starts there, one position before depth d's does."""

from __future__ import annotations

import torch

from engine.prompt_embeds import InputEmbeds
from spec.draft_runner import DraftInput
from spec.state import SpecRequestState


class DraftExtend:
    def __init__(
        self,
        state: SpecRequestState,
        tokens: list[int],
        target_hidden: torch.Tensor,
        input_embeds: InputEmbeds | None = None,
    ) -> None:
        """tokens: committed x_0..x_m; target_hidden: the target's at [valid_0, m-1];
        input_embeds: the rows the target read in place of the embeddings of x_{valid_0}, ...
        (given vectors), which every depth reads in place of those tokens' embeddings too."""
        self.state = state
        self.input_embeds = input_embeds
        self.embeds_start = state.seqs[0].valid_len
        self.tokens = tokens
        self.m = len(tokens) - 1
        self.target_hidden = target_hidden
        # Depth d+1 reads the boundary that depth d kept last time, so keep those before
        # depth d overwrites them with this extend's.
        self.old_boundary = list(state.boundary)
        self.chain: list[int] = []
        self.chain_probs: list[float] = []
        self.prev_output = target_hidden  # the hidden states the next depth reads
        self.prev_start = state.seqs[0].valid_len  # ... from this position on

    def input_for(self, depth: int) -> DraftInput:
        seq = self.state.seqs[depth]
        start = seq.valid_len
        hidden = self.prev_output
        if self.prev_start > start:  # the position depth-1 did not recompute: its boundary
            assert depth > 0 and self.prev_start == start + 1
            boundary = self.old_boundary[depth - 1]
            hidden = torch.cat([boundary[None].to(hidden.dtype), hidden])
        first, end = start + depth + 1, self.m + depth + 1  # positions of the tokens read
        tokens = (self.tokens + self.chain)[first:end]
        embeds = None
        if self.input_embeds is not None:
            embeds = self.input_embeds.window(first - self.embeds_start, end - self.embeds_start)
        return DraftInput(seq, start, tokens, hidden, embeds)

    def take(self, depth: int, output: torch.Tensor, token: int, prob: float) -> None:
        """Depth `depth` produced `output` over [valid, m-1] and proposed `token`."""
        seq = self.state.seqs[depth]
        last_depth = depth == len(self.state.seqs) - 1
        if not last_depth and self.m - depth - 1 >= 0:
            self.state.boundary[depth] = output[self.m - depth - 1 - seq.valid_len].clone()
        self.chain.append(token)
        self.chain_probs.append(prob)
        self.prev_start, self.prev_output = seq.valid_len, output
        seq.valid_len = max(0, self.m - depth)

    def finish(self) -> None:
        self.state.chain, self.state.chain_probs = self.chain, self.chain_probs
        self.state.target_hidden = self.target_hidden[-1].clone()
