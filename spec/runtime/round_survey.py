"""Which verify paths can run for one decode step's requests: the worker's answers to the round
plan's `feasible` (spec.runtime.round_plan), each gathered when the plan first asks, and kept for
the step that runs that path (`take`).

- "queued_by_device", "queued_by_host": the verify queued behind the last round, of these
  requests with their tokens, can be taken for a round on the device: its inputs gather (from
  the device for one the device queued: no chain or tree is read on the host) and the
  fixed-shape extend fits them. A tree verify the device queued whose trees cannot be
  gathered there (a request near its max_tokens) is taken with the trees read on the host.
- "device": a fresh round on the device (spec.runtime.device_round.gather_round,
  spec.runtime.tree_round.gather_tree_round, and `FixedDecodeExtend.fits`).
- "fixed": after the host's verify, the fixed-shape extend fits every request that may go on
  drafting (those that verify drafts; each commits at least one token), from what they hold
  before the step: the requests that go on are some of them, and what fits them all fits
  those."""

from __future__ import annotations

from engine.request import Request
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.device_round import LaunchedVerify, RoundInputs, gather_round
from spec.runtime.tree import TreeShape
from spec.runtime.tree_round import TreeRoundInputs, gather_tree_round


class RoundSurvey:
    def __init__(
        self,
        requests: list[Request],
        k: int,
        shape: TreeShape,
        fixed_extend: FixedDecodeExtend,
        max_context_len: int,
        launched: LaunchedVerify | None,
        shape_of,
    ) -> None:
        """`launched`: the verify queued behind the last round, where it is of `requests`;
        `shape_of(req)`: the draft shape `req` drafts (a grammar's request drafts chains)."""
        self.requests = requests
        self.k = k
        self.shape = shape
        self.fixed_extend = fixed_extend
        self.max_context_len = max_context_len
        self.launched = launched
        self.shape_of = shape_of
        self._inputs: dict[str, RoundInputs | TreeRoundInputs | None] = {}
        self._answers: dict[str, bool] = {}

    def feasible(self, path: str) -> bool:
        if path not in self._answers:
            self._answers[path] = self._check(path)
        return self._answers[path]

    def take(self, path: str) -> RoundInputs | TreeRoundInputs:
        """The inputs `feasible(path)` gathered (it answered True)."""
        inputs = self._inputs.get(path)
        assert self._answers.get(path) and inputs is not None, f"{path} was not found feasible"
        return inputs

    def _check(self, path: str) -> bool:
        if path == "fixed":
            return self._fixed_after_host()
        inputs = self._gather(path)
        self._inputs[path] = inputs
        return inputs is not None

    def _gather(self, path: str) -> RoundInputs | TreeRoundInputs | None:
        requests, k, rows = self.requests, self.k, self.max_context_len
        fixed = self.fixed_extend
        launched = self.launched if path.startswith("queued_") else None
        if path.startswith("queued_") and launched is None:
            return None
        if self.shape.is_chain:
            if launched is not None:
                # Queued from the device, its chains are there: the host reads none of them.
                inputs = launched.inputs or gather_round(requests, k, rows, chains_read=False)
            else:
                inputs = gather_round(requests, k, rows)
            fits = inputs is not None and fixed.fits(inputs.items, inputs.gathered)
            return inputs if fits else None
        if fixed.layout is None:
            return None
        budget = fixed.layout.budget
        if launched is not None and launched.tree_nodes is not None:
            # Queued from the device: the host reads none of the trees it verifies.
            trees = gather_tree_round(requests, k, budget, rows, launched.tree_nodes)
            if trees is not None and fixed.fits(trees.items, trees.gathered):
                return trees
        trees = gather_tree_round(requests, k, budget, rows)
        return trees if trees is not None and fixed.fits(trees.items, trees.gathered) else None

    def _fixed_after_host(self) -> bool:
        drafting = [req for req in self.requests if req.spec_state is not None and req.lookahead]
        if not drafting or any(self.shape_of(req) != self.shape for req in drafting):
            return False
        return self.fixed_extend.fits_states(
            [(req.spec_state, req.num_tokens - 1) for req in drafting]
        )
