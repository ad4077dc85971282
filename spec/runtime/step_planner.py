"""The worker's choice of each decode step's plan (spec.runtime.round_plan): the plan's inputs
gathered from the step's requests, the drafts plain steps left behind (spec.runtime.catch_up), the
verify queued behind the last round and the costs the engine measured (spec.runtime.round_costs),
which the step's plan is then recorded in.

A step launched while the one before it still runs on the device (engine.executor.overlap) is
planned from requests whose newest token the host has not read yet: it may only be a plain step that
catches nothing up (`plan(..., plain_only=True)`), which such a step's stale view cannot get
wrong (a plain step is lossless whatever the drafts hold). Any other plan is dropped unrecorded,
and the engine plans the step again once the step in flight is read."""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.request import Request
from spec.runtime.catch_up import DraftCatchUp
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.device_round import LaunchedVerify
from spec.runtime.round_costs import StepCosts
from spec.runtime.round_plan import (
    PlanInputs,
    PlanPolicy,
    Queued,
    RoundPlan,
    past_disable_batch_size,
    plain_past_limit,
    plan_round,
)
from spec.runtime.round_survey import RoundSurvey
from spec.runtime.tree import TreeShape


def plan_policy(config: EngineConfig) -> PlanPolicy:
    """The round plans an engine of `config` chooses (spec.runtime.round_plan)."""
    return PlanPolicy(
        speculation=config.speculative_plan,
        disable_batch_size=config.speculative_disable_batch_size,
    )


class StepPlanner:
    def __init__(
        self,
        policy: PlanPolicy,
        num_draft_steps: int,
        shape: TreeShape,
        fixed_extend: FixedDecodeExtend,
        max_context_len: int,
        catch_up: DraftCatchUp,
        shape_of: Callable[[Request], TreeShape],
    ) -> None:
        """`shape_of(req)`: the draft shape `req` drafts (a grammar's request drafts chains)."""
        self.policy = policy
        self.costs = StepCosts()
        self.num_draft_steps = num_draft_steps
        self.shape = shape
        self.fixed_extend = fixed_extend
        self.max_context_len = max_context_len
        self.catch_up = catch_up
        self.shape_of = shape_of

    def plan(
        self,
        requests: list[Request],
        waiting: bool,
        launched: LaunchedVerify | None,
        plain_only: bool = False,
    ) -> tuple[RoundPlan, RoundSurvey | None] | None:
        """The plan of the decode step of `requests` that begins now, and what it found of
        the verify paths (`RoundSurvey`, which the step's round takes its inputs from; None
        where the disable batch size alone made it plain);
        `waiting`: prompts wait for admission; `launched`: the verify queued behind the last
        round. With `plain_only`, None (and nothing recorded) unless the plan is a plain step
        that catches nothing up (see the module's doc)."""
        queued: Queued = "none"
        if launched is not None and launched.runs(requests):
            queued = "by_host" if launched.inputs is not None else "by_device"
        survey = None
        if past_disable_batch_size(len(requests), queued, self.policy):
            # The plan plan_round would make, from the two answers it reads here.
            has_drafts = any(req.lookahead and req.spec_state is not None for req in requests)
            plan = plain_past_limit(self.policy, has_drafts, self.catch_up.over_cap(requests))
        else:
            plan, survey = self._plan(requests, waiting, launched, queued)
        if plain_only and (plan.speculates or plan.catches_up):
            return None
        self.costs.step_started(plan.speculates, plan.catches_up, len(requests))
        return plan, survey

    def _plan(
        self, requests: list[Request], waiting: bool, launched: LaunchedVerify | None,
        queued: Queued,
    ) -> tuple[RoundPlan, RoundSurvey]:  # fmt: skip
        k = self.num_draft_steps
        survey = RoundSurvey(
            requests, k, self.shape, self.fixed_extend, self.max_context_len,
            launched if queued != "none" else None, self.shape_of,
        )  # fmt: skip
        behind = self.catch_up.behind(requests)
        inputs = PlanInputs(
            batch_size=len(requests),
            kind="chain" if self.shape.is_chain else "tree",
            num_drafts=k,
            drafting=behind.drafting,
            behind=behind.requests,
            pending_positions=behind.positions,
            over_cap=behind.over_cap,
            queued=queued,
            waiting=waiting,
            costs=self.costs.facts(len(requests)),
            feasible=survey.feasible,
        )
        return plan_round(inputs, self.policy), survey
