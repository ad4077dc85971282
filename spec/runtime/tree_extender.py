"""The general draft extend: every depth over a batch of `DraftExtend` items (prefill, and the
decode steps whose shape the fixed extend of spec/runtime/decode_extend.py does not fit), growing
each item's draft tree (spec/runtime/tree.py) level by level.

Each item's main extend runs its depths over the newly committed tokens and, past them, over
its greedy chain: depth d's last position reads the chain's draft d and proposes draft d + 1.
The chain's drafts stay on the device until every depth has run: depth d reads them from
`chains`, so the host queues the next depth while the device runs this one. Items whose shape is
a tree grow their trees by the rule of the fixed-shape extend (spec.runtime.tree.TreeGrowth, on the
device); after each depth the host reads the nodes the next depth expands beside the greedy
one (`TreeFork`), each a fork of the depth's sequence that recomputes only the positions whose
tokens are its path's drafts (spec/runtime/draft_extend.py). The two extends differ in how a fork's
positions are run, not in the tree: here a fork is a sequence of its own, in slots taken for
the depth, and a depth short of rows or slots for the forks expands the greedy nodes alone
(the fixed extend's forks are rows of fixed shape in its spans, which a batch either fits
whole or does not take)."""

from __future__ import annotations

import itertools

import torch

from engine.executor.host_copy import int_tensor
from spec.draft_vocab import DraftHead
from spec.runtime.draft_extend import DraftExtend
from spec.runtime.draft_runner import DraftInput, DraftRunner, DraftSeq, DraftTokenPatch
from spec.runtime.tree import DraftTree, TreeGrowth


class TreeFork:
    """A tree node other than the greedy chain's, expanded by draft depth `level`: that depth
    runs over positions [max(0, m - level), m - 1], reading the node's path (level 1 to its own
    token) and the hidden states its parent's expansion produced there."""

    def __init__(self, item: DraftExtend, path: list[int], parent_rows: torch.Tensor) -> None:
        self.item = item
        self.level = len(path)
        self.path = path
        # The parent's output at positions [max(0, m - level + 1), m - 1].
        self.parent_rows = parent_rows
        self.seq: DraftSeq | None = None
        self.output: torch.Tensor | None = None  # this node's own rows, once run

    def shared_len(self) -> int:
        """Positions of the depth's sequence the fork reads from the main extend's KV."""
        return max(0, self.item.m - self.level)

    def input_for(self) -> DraftInput:
        assert self.seq is not None
        m, level, start = self.item.m, self.level, self.shared_len()
        rows: list[torch.Tensor] = []
        if m - level >= 0:  # depth level-1's output at m - level read x_m: every path's
            rows.append(self.item.state.boundary[level - 1][None])
        if self.parent_rows.shape[0]:
            rows.append(self.parent_rows)
        # Position i reads token x_{i + level + 1}: draft (i + level + 1 - m) of the path.
        tokens = self.path[start + level - m :]
        return DraftInput(self.seq, start, tokens, tuple(rows))


class TreeExtender:
    def __init__(self, depths: list[DraftRunner], head: DraftHead, device: torch.device) -> None:
        self.depths = depths
        self.head = head
        self.device = device
        self.k = len(depths)

    def run(self, items: list[DraftExtend]) -> None:
        """Extend every depth over `items`, giving each its next chain and, for tree shapes,
        its tree. The forks' sequences are released after each depth, also on failure."""
        if not items:
            return
        live: list[tuple[DraftRunner, TreeFork]] = []
        try:
            self._extend_depths(items, live)
        finally:
            for runner, fork in live:
                if fork.seq is not None:
                    runner.release(fork.seq)

    def _extend_depths(
        self, items: list[DraftExtend], live: list[tuple[DraftRunner, TreeFork]]
    ) -> None:
        num_items, k = len(items), self.k
        device = self.device
        chains = torch.zeros((num_items, k), dtype=torch.int64, device=device)
        probs = torch.zeros((num_items, k), dtype=torch.float32, device=device)
        trees = [item for item in items if not item.shape.is_chain]
        growth = None
        if trees:
            shape = trees[0].shape
            assert all(item.shape == shape for item in trees), "one tree shape a batch"
            growth = TreeGrowth(shape, k, len(trees), device)
        forks: list[TreeFork] = []  # the nodes this depth expands beside the main chains
        for depth, runner in enumerate(self.depths):
            inputs = [item.input_for(depth) for item in items]
            columns = [item.draft_columns(depth) for item in items]
            if forks:
                forks = self._fork(runner, inputs, forks, live)
                inputs += [fork.input_for() for fork in forks]
            patch = _draft_token_patch(inputs, columns, chains)
            flat, lens, proposal = runner.forward_flat(inputs, patch)
            outputs = flat.split(lens)
            width = max(item.shape.width_at(depth) for item in items)
            if proposal is not None:  # the graph ran the head, for at least `width` tokens
                best, best_p = proposal.top[:, :width], proposal.top_p[:, :width]
            else:
                ends = list(itertools.accumulate(lens))
                last = flat.index_select(0, int_tensor(ends, flat.device) - 1)
                # A depth's output is hidden_size wide whatever the target's stream: norm and
                # head only.
                best, best_p = self.head.propose_top(last, width)
            chains[:, depth] = best[:num_items, 0]
            probs[:, depth] = best_p[:num_items, 0]
            for item, out in zip(items, outputs):
                item.take(depth, out)
            for fork, out in zip(forks, outputs[num_items:]):
                fork.output = out
            for fork in forks:
                assert fork.seq is not None
                runner.release(fork.seq)
                fork.seq = None
            if growth is not None:
                forks = self._grow(growth, items, forks, depth, best, best_p, outputs)
        # One copy to the host (ids are exact in float64): each item's chain, then its drafts'
        # probabilities.
        host = torch.cat([chains.double(), probs.double()], dim=1).tolist()
        selected = iter(growth.select().long().tolist() if growth is not None else [])
        for item, row in zip(items, host):
            tree = None
            if not item.shape.is_chain:
                nodes = next(selected)
                budget = len(nodes) // 3
                tree = DraftTree(nodes[:budget], nodes[budget : 2 * budget], nodes[2 * budget :])
            item.finish([int(t) for t in row[:k]], row[k:], tree)

    def _fork(
        self,
        runner: DraftRunner,
        inputs: list[DraftInput],
        forks: list[TreeFork],
        live: list[tuple[DraftRunner, TreeFork]],
    ) -> list[TreeFork]:
        """Forks of this depth's sequences for `forks`, or none where the depth lacks the rows
        or slots for them (the depth then expands the trees' greedy nodes alone)."""
        # Forks share the main sequences' slots, so those are taken first.
        runner.grow_many([(i.seq, i.start + len(i.token_ids)) for i in inputs])
        own = sum(fork.level for fork in forks)
        if not runner.can_fork(len(forks), own):
            return []
        parents = [(fork.item.state.seqs[fork.level], fork.shared_len()) for fork in forks]
        for fork, seq in zip(forks, runner.fork(parents)):
            fork.seq = seq
            live.append((runner, fork))
        return forks

    def _grow(
        self,
        growth: TreeGrowth,
        items: list[DraftExtend],
        forks: list[TreeFork],
        depth: int,
        best: torch.Tensor,
        best_p: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
    ) -> list[TreeFork]:
        """Add what depth `depth` proposed to the trees (`growth`: the items whose shape is a
        tree, in order), and the forks of the nodes the next depth expands beside each tree's
        greedy node (`TreeGrowth.add_level`'s choice)."""
        num_items = len(items)
        trees = [i for i, item in enumerate(items) if not item.shape.is_chain]
        per_tree = len(forks) // len(trees)  # forks are run for every tree or none
        # Each tree's expanded nodes' rows in the batch: its main input's, then its forks'.
        rows = [
            [i] + [num_items + t * per_tree + j for j in range(per_tree)]
            for t, i in enumerate(trees)
        ]
        index = int_tensor(rows, best.device)
        count = growth.shape.width_at(depth)
        growth.add_level(depth, best[index, :count], best_p[index, :count])
        if depth + 1 >= self.k:
            return []
        size = len(trees)
        paths = growth.beam_paths[:, 1:]
        num_forks = paths.shape[1]
        host = torch.cat([paths.reshape(size, -1), growth.parent_beam], dim=1).tolist()
        level = depth + 1  # the level of the next forks' nodes
        next_forks = []
        for t, i in enumerate(trees):
            item = items[i]
            # The node reads its parent's rows at [max(0, m - level + 1), m - 1]: the last of
            # the parent's expansion (all of a fork's, the main chain's newest).
            m = item.m
            count = m - max(0, m - level + 1)
            for j in range(num_forks):
                parent = host[t][num_forks * level + j]
                parent_out = outputs[i] if parent == 0 else forks[t * per_tree + parent - 1].output
                assert parent_out is not None
                path = host[t][j * level : (j + 1) * level]
                rows_read = parent_out[parent_out.shape[0] - count :]
                next_forks.append(TreeFork(item, path, rows_read))
        return next_forks


def _draft_token_patch(
    inputs: list[DraftInput], columns: list[range], chains: torch.Tensor
) -> DraftTokenPatch | None:
    """Where the drafts that the main inputs read sit in the batch's tokens (each input's last
    tokens), and their ids, gathered from `chains` (input i reads row i's `columns[i]`). Forks,
    after the main inputs, read tokens known on the host."""
    positions, rows, cols = [], [], []
    offset = 0
    for i, item in enumerate(inputs):
        offset += len(item.token_ids)
        if i >= len(columns):
            continue
        read = columns[i]
        positions += range(offset - len(read), offset)
        rows += [i] * len(read)
        cols += read
    if not positions:
        return None
    index = int_tensor([positions, rows, cols], chains.device)
    return DraftTokenPatch(index[0], chains[index[1], index[2]])
