"""Drafts that fall behind over plain steps, and catch up before speculation resumes.

A plain step (spec.runtime.round_plan) commits one token a request without running the draft. The
request keeps its draft state as it was: each depth's KV up to where the last extend left it,
and the target's hidden state at every position a plain step committed since
(`SpecRequestState.kept_hidden`), which is what depth 0 reads there. Catching up is the
general draft extend over those positions (spec.runtime.draft_extend): the same alignment as an
extend after a round that committed that many tokens, so the request's next round verifies the chain
it would have drafted had it speculated all along, with no prefill of the draft again.

A request keeps at most `max_kept` hidden states (KEPT_HIDDEN_BYTES of them): the plain step
that finds one there catches the drafts up, whatever the plan of the steps after it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import Request
from spec.runtime.draft_extend import DraftExtend
from spec.runtime.state import SpecRequestState
from spec.runtime.tree import TreeShape
from spec.runtime.tree_extender import TreeExtender

# The most bytes of target hidden states a request keeps while plain steps leave its draft
# behind (8 MiB: 1,000 positions of a 4096-wide bfloat16 draft input, 170 of a 3 x 8192-wide
# one); a batch's plain step keeps one row per request, so a batch keeps at most this much a
# request.
KEPT_HIDDEN_BYTES = 8 << 20


@dataclass(frozen=True)
class Behind:
    """The requests of a step whose drafts plain steps left behind, among those that may
    verify drafts: how many, their positions to catch up in all, and whether some request
    keeps as many hidden states as it may; and `drafting`, whether some other request that may
    verify drafts has its drafts current (the round plan's `drafting`, found in the same walk
    over the batch)."""

    requests: int = 0
    positions: int = 0
    over_cap: bool = False
    drafting: bool = False


class DraftCatchUp:
    def __init__(self, extender: TreeExtender, hidden_width: int, itemsize: int) -> None:
        """`hidden_width`: the draft input's width (spec_hidden_size), `itemsize` its bytes."""
        self.extender = extender
        self.max_kept = max(1, KEPT_HIDDEN_BYTES // (hidden_width * itemsize))
        # The draft states that keep hidden states, by id: a step finds none behind at the
        # cost of one test while speculation runs.
        self._behind: set[int] = set()
        # Those that keep `max_kept` or more: a step finds none over the cap at the cost of
        # one test while rounds are off (`over_cap`).
        self._full: set[int] = set()

    def behind(self, requests: list[Request]) -> Behind:
        if not self._behind:
            # Nothing behind: the first request that may verify drafts has them current.
            drafting = any(req.lookahead and req.spec_state is not None for req in requests)
            return Behind(drafting=drafting)
        count = positions = 0
        over_cap = drafting = False
        max_kept = self.max_kept
        for req in requests:
            state = req.spec_state
            if state is None or not req.lookahead:
                continue
            kept = len(state.kept_hidden)
            if kept:
                count += 1
                positions += kept
                over_cap = over_cap or kept >= max_kept
            else:
                drafting = True
        return Behind(count, positions, over_cap, drafting)

    def over_cap(self, requests: list[Request]) -> bool:
        """`behind(requests).over_cap`, walking the batch only while some request keeps
        `max_kept` hidden states or more."""
        if not self._full:
            return False
        full = self._full
        return any(
            req.lookahead and req.spec_state is not None and id(req.spec_state) in full
            for req in requests
        )

    def keep(self, requests: list[Request], hidden: torch.Tensor) -> None:
        """After a plain step of `requests` committed one token each: each request still
        running keeps row i of `hidden` [n, width], the target's hidden state at the position
        before its new token."""
        max_kept = self.max_kept
        for i, req in enumerate(requests):
            state: SpecRequestState | None = req.spec_state
            if state is None or req.finished:
                continue
            kept = state.kept_hidden
            if not kept:
                self._behind.add(id(state))
            kept.append((hidden, i))
            if len(kept) == max_kept:
                self._full.add(id(state))

    def run(self, requests: list[Request], shape_of: Callable[[Request], TreeShape]) -> None:
        """The general draft extend over the positions each request that may verify drafts
        is behind, drafting its next chain (or tree); depth 0 reads the kept hidden states."""
        self.extender.run(self.take(requests, shape_of))

    def take(
        self, requests: list[Request], shape_of: Callable[[Request], TreeShape]
    ) -> list[DraftExtend]:
        """The extends `run` runs, each request's kept hidden states taken into its own: its
        draft counts as current from here on."""
        items = []
        for req in requests:
            state: SpecRequestState | None = req.spec_state
            if state is None or req.finished or not req.lookahead or not state.kept_hidden:
                continue
            kept = state.kept_hidden
            assert len(kept) == req.num_tokens - 1 - state.seqs[0].valid_len
            hidden = torch.stack([batch[row] for batch, row in kept])
            state.kept_hidden = []
            self._behind.discard(id(state))
            self._full.discard(id(state))
            items.append(DraftExtend(state, req.all_token_ids, hidden, None, shape_of(req)))
        return items

    def forget(self, state: SpecRequestState) -> None:
        """`state` is released."""
        self._behind.discard(id(state))
        self._full.discard(id(state))
