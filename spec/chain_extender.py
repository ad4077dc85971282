"""The general draft extend: every depth over a batch of `DraftExtend` items (prefill, and the
decode steps whose shape the fixed extend of spec/decode_extend.py does not fit), with the
alternative chains forked from depth 1 on (spec/alternatives.py verifies them)."""

from __future__ import annotations

import itertools

import torch

from engine.host_copy import int_tensor
from spec.draft_extend import ChainFork, DraftExtend
from spec.draft_runner import DraftInput, DraftRunner, DraftTokenPatch
from spec.draft_vocab import DraftHead


class ChainExtender:
    def __init__(self, depths: list[DraftRunner], head: DraftHead, device: torch.device) -> None:
        self.depths = depths
        self.head = head
        self.device = device
        self.k = len(depths)

    def run(self, items: list[DraftExtend]) -> None:
        """Extend every depth over `items`, giving each its next chain (and its alternatives'
        first steps); the forks' own sequences are released afterwards, also on failure."""
        if not items:
            return
        forks: list[ChainFork] = []
        try:
            self._extend_depths(items, forks)
        finally:
            for fork in forks:
                for runner, seq in zip(self.depths[1:], fork.seqs):
                    runner.release(seq)

    def _extend_depths(self, items: list[DraftExtend], forks: list[ChainFork]) -> None:
        """Every depth over `items`, and over their forks from depth 1 on, which this fills in
        (the caller releases them, also after a failure).

        The drafts stay on the device until every depth has run: depth d reads the tokens that
        depths 0..d-1 proposed from `chains` (one row per item, then per fork), so the host
        queues the next depth while the device runs this one, and one copy brings all chains
        to the host at the end."""
        num_items, k = len(items), self.k
        device = self.device
        chains = torch.zeros((num_items, k), dtype=torch.int64, device=device)
        probs = torch.zeros((num_items, k), dtype=torch.float32, device=device)
        for depth, runner in enumerate(self.depths):
            inputs = [item.input_for(depth) for item in items]
            columns = [item.draft_columns(depth) for item in items]
            if depth and forks:
                # Forks share the main sequences' slots, so those must be taken first.
                runner.grow_many([(i.seq, i.start + len(i.token_ids)) for i in inputs])
                parents = [(f.main.state.seqs[depth], f.shared_len(depth)) for f in forks]
                for fork, seq in zip(forks, runner.fork(parents)):
                    fork.seqs.append(seq)
                inputs += [fork.input_for(depth) for fork in forks]
                columns += [fork.draft_columns(depth) for fork in forks]
            patch = _draft_token_patch(inputs, columns, chains)
            flat, lens, proposal = runner.forward_flat(inputs, patch)
            outputs = flat.split(lens)
            # Depth 0 also ranks the first tokens of the alternatives.
            width = max(item.num_chains for item in items) if depth == 0 else 1
            if proposal is not None:  # the graph ran the head, for at least `width` tokens
                best, best_p = proposal.top[:, :width], proposal.top_p
            else:
                ends = list(itertools.accumulate(lens))
                last = flat.index_select(0, int_tensor(ends, flat.device) - 1)
                # A depth's output is hidden_size wide whatever the target's stream: norm and
                # head only.
                best, best_p = self.head.propose_top(last, width)
            chains[: best.shape[0], depth] = best[:, 0]
            probs[:, depth] = best_p[:num_items]
            for item, out in zip(items, outputs):
                item.take(depth, out)
            for fork, out in zip(forks, outputs[num_items:]):
                fork.take(out)
            if depth == 0:
                forks += self._forks(items, best.shape[1])
                if forks:
                    where = int_tensor(
                        [[f.main_index for f in forks], [f.rank for f in forks]], device
                    )
                    first = best[where[0], where[1]]
                    fork_rows = torch.zeros((len(forks), k), dtype=torch.int64, device=device)
                    fork_rows[:, 0] = first
                    chains = torch.cat([chains, fork_rows])
        # One copy to the host (ids are exact in float64): each row's chain, then for items
        # each draft's probability.
        if forks:
            probs = torch.cat([probs, probs.new_zeros((len(forks), k))])
        host = torch.cat([chains.double(), probs.double()], dim=1).tolist()
        for fork, row in zip(forks, host[num_items:]):
            fork.chain = [int(t) for t in row[:k]]
        for item, row in zip(items, host):
            item.finish([int(t) for t in row[:k]], row[k:])

    def _forks(self, items: list[DraftExtend], ranked: int) -> list[ChainFork]:
        """The alternative chains of `items`, started with the tokens depth 0 ranked after each
        main chain's first (`ranked`: how many depth 0 ranked per item). None where a depth
        lacks the rows or slots for them: they are dropped whole, and the step verifies main
        chains only."""
        forks = [
            ChainFork(item, index, rank)
            for index, item in enumerate(items)
            for rank in range(1, min(item.num_chains, ranked))
        ]
        if not forks:
            return []
        for depth, runner in enumerate(self.depths[1:], start=1):
            # The main sequences grow to m first: forks may only take what is left after.
            main = sum(max(0, item.m - len(item.state.seqs[depth].slots)) for item in items)
            own = sum(fork.main.m - fork.shared_len(depth) for fork in forks)
            if not runner.can_fork(len(forks), main + own):
                return []
        for fork in forks:
            fork.main.forks.append(fork)
        return forks


def _draft_token_patch(
    inputs: list[DraftInput], columns: list[range], chains: torch.Tensor
) -> DraftTokenPatch | None:
    """Where the drafts that `inputs` read sit in the batch's tokens (each input's last
    tokens), and their ids, gathered from `chains` (input i reads row i's `columns[i]`)."""
    positions, rows, cols = [], [], []
    offset = 0
    for i, (item, read) in enumerate(zip(inputs, columns)):
        offset += len(item.token_ids)
        positions += range(offset - len(read), offset)
        rows += [i] * len(read)
        cols += read
    if not positions:
        return None
    index = int_tensor([positions, rows, cols], chains.device)
    return DraftTokenPatch(index[0], chains[index[1], index[2]])
