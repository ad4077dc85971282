"""A draft token tree grown on the device, inside the decode step's fixed-shape draft extend
(spec/runtime/decode_extend.py): the same tree as spec/runtime/tree_extender.py grows with the host
choosing each level's nodes, built with tensor operations of fixed shape so that the whole extend
stays one forward per depth (one CUDA graph for all depths where the engine runs graphs) and one
copy to the host.

Depth d expands the nodes at level d: the greedy chain's node, which is the depth's main rows
(those of the chain's extend), and `forks[d]` others, each a fork of d rows appended to the
request's span. A fork at level d reads its path's d drafts at positions m'-d .. m'-1 (m' the
newest position after the verify: m + a + 1), sees the main rows up to position m'-d-1 and its
own rows, and reads, at m'-d, depth d-1's main output there and, after it, its parent's
outputs (the rules of spec/runtime/draft_extend.py). Its rows sit in the depth's cache positions
after the main rows, which the request's draft sequence holds for this (they are positions it will
only reach later, and every extend rewrites what it reads before reading it).

Each expanded node proposes its `width_at(d)` likeliest children; which nodes the next level
expands and which candidates are the tree after the last depth is the rule of
spec.runtime.tree.TreeGrowth, which the general extend follows too."""

from __future__ import annotations

import torch

from engine.executor.forward_batch import TREE_MAX_TOKENS
from spec.runtime.tree import TreeGrowth, TreeShape


class TreeLayout:
    """The static shape of a tree extend with `k` depths: per depth the forks beside its main
    rows (`forks`), its main rows (`main_widths`: K+1+d) and whole span (`span_widths`), and
    per level the candidates its depth proposes."""

    def __init__(self, shape: TreeShape, k: int) -> None:
        self.shape = shape
        self.k = k
        self.forks: list[int] = []
        self.level_sizes: list[int] = []  # level d+1: what depth d proposes
        expanded = 1  # the root, at depth 0
        for d in range(k):
            self.forks.append(expanded - 1)
            proposed = expanded * shape.width_at(d)
            self.level_sizes.append(proposed)
            expanded = min(shape.beam_width, proposed)
        self.num_candidates = sum(self.level_sizes)
        self.budget = min(shape.budget, self.num_candidates)
        self.main_widths = [k + 1 + d for d in range(k)]
        self.fork_rows = [f * d for d, f in enumerate(self.forks)]
        self.span_widths = [w + f for w, f in zip(self.main_widths, self.fork_rows)]

    @property
    def fits_masks(self) -> bool:
        """Whether every depth's span fits the 63 bits of a token's visibility mask
        (`TREE_MAX_TOKENS`): deep trees of wide beams do not, and take the general extend."""
        return max(self.span_widths) <= TREE_MAX_TOKENS


class ForkColumns:
    """Per depth with forks, constant index tensors over its fork rows (fork f's row r is
    column f*d + r): r, f, and each row's own-fork bits (itself and the fork's rows before it)
    shifted to its span index."""

    def __init__(self, layout: TreeLayout, device: torch.device) -> None:
        self.row: list[torch.Tensor | None] = []
        self.fork: list[torch.Tensor | None] = []
        self.own_bits: list[torch.Tensor | None] = []
        for d, (forks, width) in enumerate(zip(layout.forks, layout.main_widths)):
            if not forks:
                self.row.append(None)
                self.fork.append(None)
                self.own_bits.append(None)
                continue
            r = torch.arange(d, device=device).repeat(forks)
            f = torch.arange(forks, device=device).repeat_interleave(d)
            self.row.append(r)
            self.fork.append(f)
            self.own_bits.append(((2 << r) - 1) << (width + f * d))


class DeviceTree(TreeGrowth):
    """The trees of a batch of `size` requests while the fixed extend's depths run, and where
    each depth's forks read and attend in its span."""

    def __init__(self, layout: TreeLayout, columns: ForkColumns, size: int, device) -> None:
        super().__init__(layout.shape, layout.k, size, device)
        self.layout = layout
        self.columns = columns

    def fork_tokens(self, d: int) -> torch.Tensor:
        """[size, forks * d]: fork f's row r reads draft r+1 of its path."""
        paths = self.beam_paths[:, 1:]
        return paths.reshape(paths.shape[0], -1)

    def fork_hidden_rows(self, d: int, accepted: torch.Tensor) -> torch.Tensor:
        """[size, forks * d]: the row of depth d-1's span output each fork row reads: its main
        output at m'-d (row a) for row 0; after it, the parent's rows at the same positions,
        which are the main rows a+r where the parent is the greedy node, or the parent fork's
        row r-1."""
        assert self.parent_beam is not None
        r = self.columns.row[d]
        f = self.columns.fork[d]
        parent = self.parent_beam[:, f]
        a = accepted[:, None]
        previous_main = self.layout.main_widths[d - 1]
        in_fork = previous_main + (parent - 1) * (d - 1) + r - 1
        return torch.where(r == 0, a, torch.where(parent == 0, a + r, in_fork))

    def fork_bits(self, d: int, accepted: torch.Tensor) -> torch.Tensor:
        """[size, forks * d]: each fork row sees the main rows 0..a and its own fork's rows up
        to itself."""
        main = (torch.ones_like(accepted) << (accepted + 1)) - 1
        own_bits = self.columns.own_bits[d]
        assert own_bits is not None
        return main[:, None] | own_bits

    def fork_last_rows(self, out: torch.Tensor, d: int) -> torch.Tensor:
        """[size, forks, width]: each fork's last row of depth d's span output `out`, where it
        proposes (a strided slice: no index to copy to the device inside a graph)."""
        return out[:, self.layout.main_widths[d] + d - 1 :: d]
