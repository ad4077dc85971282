"""Per-request speculative state: `DraftState`, what crosses from a prefill node to a decode
node, and `SpecRequestState`, what the engine keeps on `Request.spec_state`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from spec.runtime.draft_runner import DraftSeq
from spec.runtime.tree import DraftTree

T = TypeVar("T")


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


class BatchRows(Sequence[torch.Tensor]):
    """One request's row of each of a batch's tensors: `batch[d, index]` for d in order. The
    decode step's extend leaves every request's boundary states in one tensor [K-1, n, hidden];
    a request keeps its index there instead of K-1 views of its own, so that neither keeping
    them nor reading a whole batch of them back costs an operation per request."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: torch.Tensor, index: int) -> None:
        self.batch = batch
        self.index = index

    def __len__(self) -> int:
        return self.batch.shape[0]

    def __getitem__(self, d: int) -> torch.Tensor:  # type: ignore[override]
        if not -len(self) <= d < len(self):
            raise IndexError(d)
        return self.batch[d, self.index]


def whole_batch(rows: Sequence[BatchRows | Sequence[torch.Tensor | None]]) -> torch.Tensor | None:
    """The batch tensor that holds `rows` as its rows 0..n-1 in order, when one does."""
    first = rows[0]
    if not isinstance(first, BatchRows) or first.batch.shape[1] != len(rows):
        return None
    batch = first.batch
    for i, row in enumerate(rows):
        if not isinstance(row, BatchRows) or row.batch is not batch or row.index != i:
            return None
    return batch


class DraftsOnTheirWay(Protocol):
    """A batch's next drafts on their way from the device to the host (an extend's block):
    request i's chain, the chain's probabilities and its tree (None: a chain alone), once
    they have landed (spec.runtime.extend_items.PendingDrafts)."""

    def drafts(self, i: int) -> tuple[list[int], list[float], DraftTree | None]: ...


class Drafted(Generic[T]):
    """One of a request's next drafts (`SpecRequestState.chain`, `chain_probs`, `tree`), kept
    in the field of its name with an underscore: read or written, it first lets the drafts on
    their way land."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = "_" + name

    def __get__(self, state: SpecRequestState | None, owner: type | None = None) -> T:
        if state is None:
            return self  # type: ignore[return-value]
        state._landed()
        return getattr(state, self.field)

    def __set__(self, state: SpecRequestState, value: T) -> None:
        state._landed()
        setattr(state, self.field, value)


@dataclass
class SpecRequestState:
    """`chain`, `chain_probs` and `tree`: the drafts the next verify checks, read from the
    extend that proposed them only when someone asks (`drafts_from`). A round decided on the
    device asks for none of them while the device queues its next verify, so the host commits
    a round's tokens while the device still runs the round's extend."""

    seqs: list[DraftSeq]  # one per depth, each in that depth's own pools
    # boundary[d] (d < K-1): depth d's output at position m-d-1 (m: the newest token's
    # position), None while m-d-1 < 0. Depth d+1's next extend starts there. A list, or the
    # request's rows of the batch the decode step's extend ran in.
    boundary: list[torch.Tensor | None] | BatchRows = field(default_factory=list)
    # The target's at position m-1, or (a batch's tensor, index) to read it from: the decode
    # step's extend keeps its verify's hidden states whole, read only if someone asks.
    hidden_at: torch.Tensor | tuple[torch.Tensor, tuple[int, int]] | None = None

    # [K] draft tokens for the next verify, their probabilities, and the draft tree it checks
    # when the engine drafts trees (spec/runtime/tree.py; None: the chain alone). Read and written
    # through `chain`, `chain_probs` and `tree` below.
    _chain: list[int] = field(default_factory=list, init=False, repr=False)
    _chain_probs: list[float] = field(default_factory=list, init=False, repr=False)
    _tree: DraftTree | None = field(default=None, init=False, repr=False)
    # The target's hidden states at the positions that plain steps (spec.runtime.round_plan)
    # committed since the draft's last extend, oldest first: (a step's hidden states [batch, width],
    # this request's row there). Depth 0 reads them when the draft catches up over those positions.
    kept_hidden: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    # The leading positions whose KV in every depth the prefix cache holds for this request
    # (spec/runtime/prefix_drafts.py): its match's, then what it gave the cache.
    cached_drafts: int = 0
    # Where the next drafts come from while they are on their way to the host: the batch's
    # drafts and this request's index there.
    _pending: tuple[DraftsOnTheirWay, int] | None = field(default=None, init=False, repr=False)

    def drafts_from(self, drafts: DraftsOnTheirWay, index: int) -> None:
        """The next drafts are request `index`'s of `drafts`, read when first asked for."""
        self._pending = (drafts, index)

    def wait_for_drafts(self) -> None:
        """Wait until the extend that proposes the next drafts has run, if it may still be
        running: it writes this request's draft KV until then."""
        self._landed()

    def _landed(self) -> None:
        if self._pending is not None:
            drafts, index = self._pending
            self._pending = None
            self._chain, self._chain_probs, self._tree = drafts.drafts(index)

    # Not fields: each reads or writes its underscored field once the drafts have landed.
    chain = Drafted["list[int]"]()
    chain_probs = Drafted["list[float]"]()
    tree = Drafted["DraftTree | None"]()

    @property
    def target_hidden(self) -> torch.Tensor | None:
        """The target's hidden state at position m-1."""
        if isinstance(self.hidden_at, tuple):
            batch, index = self.hidden_at
            return batch[index]
        return self.hidden_at

    @target_hidden.setter
    def target_hidden(self, value: torch.Tensor | None) -> None:
        self.hidden_at = value
