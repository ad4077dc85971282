"""What the decode step's fixed-shape draft extend (spec/decode_extend.py) reads of its
requests: one `FixedExtendItem` per request, their integers gathered into arrays once
(`GatheredItems`), each depth's slots grown from those arrays, and the chains it proposes read
back on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.allocator import PADDING_SLOT
from engine.host_copy import HostCopy
from spec.draft_runner import DraftRunner, DraftSeq
from spec.state import SpecRequestState


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
        return cls(
            np.array(newest, dtype=np.int64),
            np.array(num_positions, dtype=np.int64),
            by_depth,
            np.array([[seq.row for seq in depth] for depth in by_depth], dtype=np.int64),
            np.array([[len(seq.slots) for seq in depth] for depth in by_depth], dtype=np.int64),
        )

    def aligned(self, k: int) -> bool:
        """Whether every depth d is valid up to where this extend starts (m-d >= 1), read from
        the sequences now: an extend applied since the gathering moves them."""
        valid = np.array([[seq.valid_len for seq in depth] for depth in self.seqs])
        expected = self.newest[None, :] - np.arange(len(self.seqs))[:, None]
        return bool(self.newest.min() >= k and (valid == expected).all())


def grow_depths(depths: list[DraftRunner], items: GatheredItems, k: int) -> None:
    """Each depth's slots up to position m+K of every item (the padding rows write there too):
    a sequence short of them takes every position its item may hold; entries past those point
    at the padding slot, since the extend reads its KV slots from the row table and an entry
    there may hold a slot that another request owns now (they are overwritten when the
    sequence grows)."""
    end = items.newest + k + 1
    reach = np.minimum(end, items.num_positions)
    short = items.held < reach
    held = np.maximum(items.held, reach)
    padding = held < end
    if not (short.any() or padding.any()):
        return
    for d, runner in enumerate(depths):
        seqs = items.seqs[d]
        grown = np.flatnonzero(short[d]).tolist()
        if grown:
            runner.grow_many([(seqs[i], int(items.num_positions[i])) for i in grown])
            items.rows[d, grown] = [seqs[i].row for i in grown]
        padded = np.flatnonzero(padding[d]).tolist()
        if padded:
            runner.req_to_token_pool.write_many(
                [(seqs[i].row, int(held[d, i]), [PADDING_SLOT] * int(end[i] - held[d, i]))
                 for i in padded]
            )  # fmt: skip


def split_chains(copy: HostCopy) -> tuple[list[list[int]], list[list[float]]]:
    """Each request's chain and the chain's probabilities from a copy of the extend's [n, 2K]
    float64 block (ids are exact in float64), once it has landed."""
    copy.wait()
    values = copy.host.numpy()
    k = values.shape[1] // 2
    return values[:, :k].astype(np.int64).tolist(), values[:, k:].tolist()
