"""The draft extend after a round's verify, over the tokens it committed, on the kind its plan
names (spec.runtime.round_plan): the one the device queued with the verify ("device", whose chains
this applies and, where the plan says, queues the next verify of), the fixed-shape extend
after the host's verify ("fixed", spec.runtime.decode_extend), or the general one ("general",
spec.runtime.tree_extender). Each request that goes on drafting is extended; one that ended, or left
speculation, is not."""

from __future__ import annotations

from collections.abc import Callable

from engine.executor.host_copy import int_tensor
from engine.request import Request
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.device_round import DeviceRound
from spec.runtime.draft_extend import DraftExtend
from spec.runtime.extend_items import FixedExtendItem
from spec.runtime.host_verify import VerifyResult
from spec.runtime.round_plan import RoundPlan
from spec.runtime.round_verify import RoundVerifier
from spec.runtime.tree import TreeShape
from spec.runtime.tree_extender import TreeExtender

# (index in the batch, request, tokens committed this step) of each request that goes on.
GoingOn = list[tuple[int, Request, int]]


class RoundExtend:
    def __init__(
        self,
        fixed_extend: FixedDecodeExtend,
        extender: TreeExtender,
        verifier: RoundVerifier,
        shape: TreeShape,
        shape_of: Callable[[Request], TreeShape],
    ) -> None:
        """`shape`: the engine's draft shape; `shape_of(req)`: the shape `req` drafts (a
        grammar's request drafts chains)."""
        self.fixed_extend = fixed_extend
        self.extender = extender
        self.verifier = verifier
        self.shape = shape
        self.shape_of = shape_of

    def run(
        self, requests: list[Request], verified: VerifyResult, committed: list[int], plan: RoundPlan
    ) -> None:
        """Extend the draft of each request of `requests` that goes on over the `committed[i]`
        tokens the scheduler committed of `verified`, as `plan` says."""
        done = verified.extended
        going_on: GoingOn = []
        for i, req in enumerate(requests):
            if req.finished or req.spec_state is None:
                continue
            # After a round on the device every request has its next chain (one with no
            # lookahead left verifies it with acceptance stopped at 0); elsewhere only those
            # that go on drafting are extended.
            if done is not None or req.lookahead:
                going_on.append((i, req, committed[i]))
        if plan.extend == "device":
            assert done is not None
            self._apply_device_extend(requests, done, going_on, plan.queue_next != "none")
        elif plan.extend == "fixed":
            self._fixed_extend(verified, going_on)
        else:
            self._general_extend(verified, going_on)

    def _apply_device_extend(
        self, requests: list[Request], done: DeviceRound, going_on: GoingOn, queue_next: bool
    ) -> None:
        """The extend ran with the verify: its chains go to those going on. With `queue_next`,
        the host queues their next verify where the device did not."""
        indices = [i for i, _, _ in going_on]
        boundary, hidden, next_chains = done.boundary, done.verify_hidden, done.next_chains
        if len(indices) < len(requests):
            kept = int_tensor(indices, boundary.device)
            boundary, hidden = boundary[:, kept], hidden[kept]
            next_chains = next_chains[kept] if queue_next else next_chains
        # Those going on are all that the round leaves running, in order: the next step's
        # batch when nothing joins.
        # A verify the device queued is of every request of the round: when some end,
        # the host queues one of those going on.
        queued = self.verifier.launched is not None and len(going_on) == len(requests)
        if queue_next and going_on and self.shape.is_chain and not queued:
            self.verifier.launch([req for _, req, _ in going_on], next_chains)
        # Read when first asked for: a round the device queues the next verify of reads
        # none, and the host goes on while the device runs the extend.
        self.fixed_extend.apply(
            [done.items[i] for i in indices],
            [committed for _, _, committed in going_on],
            done.next_drafts,
            indices,
            boundary,
            hidden,
        )

    def _fixed_extend(self, verified: VerifyResult, going_on: GoingOn) -> None:
        """The fixed-shape extend after the host's verify (the plan found that it fits every
        request that could go on, so it fits those that do)."""
        hidden = verified.hidden  # per request: the target's at the newest token and kept path
        fixed = [
            FixedExtendItem(
                req.spec_state,
                req.num_tokens - 1 - committed,
                req.all_token_ids[-committed:],
                hidden[i],
                num_positions=len(req.slots),
            )
            for i, req, committed in going_on
        ]
        if fixed:
            assert self.fixed_extend.fits(fixed)
            self.fixed_extend.run(fixed)

    def _general_extend(self, verified: VerifyResult, going_on: GoingOn) -> None:
        hidden, shape_of = verified.hidden, self.shape_of
        self.extender.run(
            [
                DraftExtend(
                    req.spec_state, req.all_token_ids, hidden[i][:committed], None, shape_of(req)
                )
                for i, req, committed in going_on
            ]
        )
