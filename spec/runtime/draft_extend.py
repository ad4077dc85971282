"""One request's way through a draft extend: which tokens and hidden states each depth reads,
and what it keeps. The alignment rules live here and nowhere else.

Depth d at position i reads token x_{i+d+1} and g^{d-1}_i (g^{-1}: the target's hidden state)
and predicts x_{i+d+2}. With committed tokens x_0..x_m, depth d runs over [valid_d, m-1]; the
tokens it reads past x_m are the new chain's drafts (depth d at m-1 reads draft d and proposes
draft d+1). Afterwards valid_d = max(0, m-d), and depth d keeps its output at m-d-1 as the
boundary: depth d+1's next extend starts there, one position before depth d's does.

A tree's other nodes (spec/runtime/tree_extender.py) are forks of the main extend: a node at level l
runs depth l over positions [m-l, m-1] alone, whose tokens are its path's drafts, reading the
main extend's KV before them and, at m-l, the boundary state depth l-1 kept in this extend (the
output there read x_m, a committed token, on every path)."""

from __future__ import annotations

import torch

from engine.executor.prompt_embeds import InputEmbeds
from spec.runtime.draft_runner import DraftInput
from spec.runtime.state import SpecRequestState
from spec.runtime.tree import DraftTree, TreeShape


class DraftExtend:
    def __init__(
        self,
        state: SpecRequestState,
        tokens: list[int],
        target_hidden: torch.Tensor,
        input_embeds: InputEmbeds | None = None,
        shape: TreeShape | None = None,
        keep_prompt_boundary: bool = False,
    ) -> None:
        """tokens: committed x_0..x_m; target_hidden: the target's at [valid_0, m-1];
        input_embeds: the rows the target read in place of the embeddings of x_{valid_0}, ...
        (given vectors), which every depth reads in place of those tokens' embeddings too;
        shape: the tree to draft (None: one chain); keep_prompt_boundary: keep
        `prompt_boundary`, for other samples of this prompt."""
        self.state = state
        self.shape = shape or TreeShape.chains(1, len(state.seqs))
        self.input_embeds = input_embeds
        self.embeds_start = state.seqs[0].valid_len
        self.tokens = tokens
        self.m = len(tokens) - 1
        self.target_hidden = target_hidden
        # Depth d+1 reads the boundary that depth d kept last time, so keep those before
        # depth d overwrites them with this extend's.
        self.old_boundary = list(state.boundary)
        state.boundary = list(self.old_boundary)  # a list of its own, which `take` writes
        # Depth d's output at m-d-2: the boundary of the state this extend would leave with
        # x_0..x_{m-1} alone, which another sample of the prompt x_0..x_{m-1}, whose x_m is its
        # own, extends from (spec/runtime/sample_extend.py).
        self.prompt_boundary: list[torch.Tensor | None] | None = None
        if keep_prompt_boundary:
            self.prompt_boundary = [None] * len(state.boundary)
        self.chain: list[int] = []
        self.chain_probs: list[float] = []
        self.prev_output = target_hidden  # the hidden states the next depth reads
        self.prev_start = state.seqs[0].valid_len  # ... from this position on

    def input_for(self, depth: int) -> DraftInput:
        """Depth `depth`'s input. The tokens it reads past x_m are this extend's drafts, which
        are still on the device: they read 0 here, and `draft_columns` says which they are."""
        seq = self.state.seqs[depth]
        start = seq.valid_len
        hidden: tuple[torch.Tensor, ...] = (self.prev_output,)
        if self.prev_start > start:  # the position depth-1 did not recompute: its boundary
            assert depth > 0 and self.prev_start == start + 1
            boundary = self.old_boundary[depth - 1]
            hidden = (boundary[None].to(self.prev_output.dtype), self.prev_output)
        first, end = self._read_range(depth)
        committed = self.tokens[first : min(end, self.m + 1)]
        tokens = committed + [0] * len(self.draft_columns(depth))
        embeds = None
        if self.input_embeds is not None:
            embeds = self.input_embeds.window(first - self.embeds_start, end - self.embeds_start)
        return DraftInput(seq, start, tokens, hidden, embeds)

    def draft_columns(self, depth: int) -> range:
        """The chain positions (0: the first draft) of the tokens that depth `depth` reads past
        x_m: its input's last tokens, in order."""
        first, end = self._read_range(depth)
        return range(max(first, self.m + 1) - self.m - 1, end - self.m - 1)

    def _read_range(self, depth: int) -> tuple[int, int]:
        """The positions, in x_0 .. x_m followed by the chain, of the tokens depth `depth`
        reads: [first, end)."""
        start = self.state.seqs[depth].valid_len
        return start + depth + 1, self.m + depth + 1

    def take(self, depth: int, output: torch.Tensor) -> None:
        """Depth `depth` produced `output` over [valid, m-1]."""
        seq = self.state.seqs[depth]
        last_depth = depth == len(self.state.seqs) - 1
        if not last_depth and self.m - depth - 1 >= 0:
            # A view: the depth's output is a tensor of its own (out of any graph buffer), kept
            # alive by the views until the next extend replaces them.
            self.state.boundary[depth] = output[self.m - depth - 1 - seq.valid_len]
        if self.prompt_boundary is not None and not last_depth:
            if self.m - depth - 2 >= seq.valid_len:
                self.prompt_boundary[depth] = output[self.m - depth - 2 - seq.valid_len]
        self.prev_start, self.prev_output = seq.valid_len, output
        seq.valid_len = max(0, self.m - depth)

    def finish(
        self, chain: list[int], chain_probs: list[float], tree: DraftTree | None = None
    ) -> None:
        """The drafts every depth proposed, once on the host: the greedy chain, and the tree
        when the shape is not a chain."""
        self.state.chain, self.state.chain_probs = chain, chain_probs
        self.state.tree = tree
        self.state.target_hidden = self.target_hidden[-1]
