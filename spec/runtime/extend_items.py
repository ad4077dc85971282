"""What the decode step's fixed-shape draft extend (spec/runtime/decode_extend.py) reads of its
requests: one `FixedExtendItem` per request, their integers gathered into arrays once
(`GatheredItems`), each depth's slots grown from those arrays, and the chains it proposes read
back on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.executor.host_copy import HostCopy
from engine.scheduling.allocator import PADDING_SLOT
from spec.runtime.draft_runner import DraftRunner, DraftSeq
from spec.runtime.state import SpecRequestState
from spec.runtime.tree import DraftTree


@dataclass
class FixedExtendItem:
    """One request going on speculating after a verify step: its state, the position of its
    newest token before the step (m), the tokens the step committed (a accepted drafts and the
    target's token) and the target's hidden states over its verify span [K+1, width].
    `num_positions`: the positions [0, num_positions) it may hold draft slots for, those it
    holds in the target: a depth that must grow takes all of them at once, so that its row
    table is written once every few steps, not every step; near max_tokens, where they end
    before the extend's m + K + 1, its rows past them write the padding slot."""

    state: SpecRequestState
    m: int
    committed: list[int]
    verify_hidden: torch.Tensor
    num_positions: int

    @property
    def accepted(self) -> int:
        return len(self.committed) - 1


@dataclass
class GatheredItems:
    """The items' integers that a launch reads, gathered in one pass: per item the position m
    of its newest token and the positions it may hold draft slots for; per depth and item the
    sequence, its row and the slots it holds."""

    newest: np.ndarray  # [n]
    num_positions: np.ndarray  # [n]
    seqs: list[tuple[DraftSeq, ...]]  # [K][n]
    rows: np.ndarray  # [K, n]
    held: np.ndarray  # [K, n]

    @classmethod
    def of(cls, items: list[FixedExtendItem]) -> GatheredItems:
        return cls.from_lists(
            [item.m for item in items],
            [item.num_positions for item in items],
            [item.state.seqs for item in items],
        )

    @classmethod
    def from_lists(
        cls, newest: list[int], num_positions: list[int], seqs: list[list[DraftSeq]]
    ) -> GatheredItems:
        """From per item its m, positions and sequences (one per depth)."""
        by_depth = list(zip(*seqs))
        shape = (len(by_depth), len(newest))
        flat = [seq for depth in by_depth for seq in depth]  # numpy reads flat lists faster
        return cls(
            np.array(newest, dtype=np.int64),
            np.array(num_positions, dtype=np.int64),
            by_depth,
            np.array([seq.row for seq in flat], dtype=np.int64).reshape(shape),
            np.array([len(seq.slots) for seq in flat], dtype=np.int64).reshape(shape),
        )

    def aligned(self, k: int) -> bool:
        """Whether every depth d is valid up to where this extend starts (m-d >= 1), read from
        the sequences now: an extend applied since the gathering moves them. In Python: for a
        few requests, building arrays to compare costs the host more."""
        newest = self.newest.tolist()
        return min(newest) >= k and all(
            seq.valid_len == m - d
            for d, depth in enumerate(self.seqs)
            for seq, m in zip(depth, newest, strict=True)
        )


# Positions a depth with forks grows by beyond what a step needs (grow_depths): a few steps'
# worth (a step moves on by at most K + 1), which every depth's pool reserves for every request.
FORK_GROW_AHEAD = 8


def grow_depths(
    depths: list[DraftRunner], items: GatheredItems, k: int, fork_rows: list[int] | None = None
) -> None:
    """Each depth's slots up to position m+K of every item (the padding rows write there too):
    when some sequence is short of them, every sequence that holds fewer positions than its
    item may hold takes them all, so that a batch's depths grow together every few rounds (the
    target grows a few rounds ahead, `spec.runtime.device_round.grow_for_next_round`) rather than
    one request at a time in almost every round. Entries past those point at the padding slot,
    since the extend reads its KV slots from the row table and an entry there may hold a slot
    that another request owns now (they are overwritten when the sequence grows). A depth with
    `fork_rows[d]` rows of a tree's forks after its main rows holds real slots up to
    m+K+fork_rows[d], past what its item may hold if need be: the forks' rows attend one
    another there. Such a depth grows FORK_GROW_AHEAD positions further when it must grow,
    within its row table: a growth is a row-table write, which each step would otherwise pay
    in every depth."""
    end = items.newest + k + 1
    if not any(fork_rows or ()) and (items.held >= end).all():
        return  # every depth holds its slots up to m+K already: most rounds
    forks = np.zeros(len(depths), dtype=np.int64) if fork_rows is None else np.array(fork_rows)
    need = np.where(
        forks[:, None] > 0, end[None, :] + forks[:, None], np.minimum(end, items.num_positions)
    )
    if (items.held >= np.maximum(need, end)).all():
        return  # the forks' depths hold theirs too: most rounds of trees
    targets = np.maximum(items.num_positions[None, :], need)
    if forks.any():
        widths = np.array([runner.req_to_token_pool.max_context_len for runner in depths])
        ahead = np.minimum(need + FORK_GROW_AHEAD, widths[:, None])
        targets = np.where(forks[:, None] > 0, np.maximum(items.num_positions, ahead), targets)
    grow = items.held < targets if (items.held < need).any() else np.zeros_like(need, bool)
    held = np.where(grow, targets, items.held)
    padding = held < end[None, :]
    for d, runner in enumerate(depths):
        seqs = items.seqs[d]
        grown = np.flatnonzero(grow[d]).tolist()
        if grown:
            runner.grow_many([(seqs[i], int(targets[d, i])) for i in grown])
            items.rows[d, grown] = [seqs[i].row for i in grown]
        padded = np.flatnonzero(padding[d]).tolist()
        if padded:
            runner.req_to_token_pool.write_many(
                [(seqs[i].row, int(held[d, i]), [PADDING_SLOT] * int(end[i] - held[d, i]))
                 for i in padded]
            )  # fmt: skip
    items.held[:] = held


class PendingDrafts:
    """A batch's next drafts in a copy of the extend's block (`FixedDecodeExtend.launch`), on
    its way to the host: split for every request at once, when some request first asks for
    its own (`SpecRequestState.drafts_from`). `tree_budget`: each tree's nodes, when the
    extend grows trees."""

    def __init__(self, copy: HostCopy, k: int, tree_budget: int | None = None) -> None:
        self.copy = copy
        self.k = k
        self.tree_budget = tree_budget
        self._split: tuple[list, list, list[DraftTree] | None] | None = None

    def drafts(self, i: int) -> tuple[list[int], list[float], DraftTree | None]:
        if self._split is None:
            chains, probs = split_chains(self.copy, self.k)
            budget = self.tree_budget
            trees = None if budget is None else split_trees(self.copy, self.k, budget)
            self._split = (chains, probs, trees)
        chains, probs, trees = self._split
        return chains[i], probs[i], None if trees is None else trees[i]


def split_chains(copy: HostCopy, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each request's chain and the chain's probabilities from a copy of the extend's float64
    block (ids are exact in float64): its first K columns, then K more, once it has landed."""
    copy.wait()
    values = copy.host.numpy()
    return values[:, :k].astype(np.int64).tolist(), values[:, k : 2 * k].tolist()


def tree_columns(k: int, budget: int) -> slice:
    """The columns of the extend's block that hold each request's tree of `budget` nodes: its
    tokens, parents and levels, after the K chain ids and their K probabilities."""
    return slice(2 * k, 2 * k + 3 * budget)


def split_trees(copy: HostCopy, k: int, budget: int) -> list[DraftTree]:
    """Each request's draft tree from the same block, after its chains (columns 2K on: the
    nodes' tokens, parents and levels; spec/runtime/device_tree.py)."""
    copy.wait()
    values = copy.host.numpy()[:, tree_columns(k, budget)].astype(np.int64)
    tokens, parents, levels = (
        values[:, :budget],
        values[:, budget : 2 * budget],
        values[:, 2 * budget :],
    )
    return [
        DraftTree(t, p, lv) for t, p, lv in zip(tokens.tolist(), parents.tolist(), levels.tolist())
    ]
