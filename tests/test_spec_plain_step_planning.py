"""What a speculating engine's plain steps cost the host to plan (spec/runtime/step_planner.py,
spec/runtime/catch_up.py): past the disable batch size the plan is made from two answers, with no
walk over the batch while nothing is over the cap, and the drafts kept behind are counted in one
walk; either way the plan is the one plan_round makes from the inputs gathered request by
request."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.request import Request
from spec.runtime.catch_up import KEPT_HIDDEN_BYTES, DraftCatchUp
from spec.runtime.draft_runner import DraftSeq
from spec.runtime.round_costs import StepCosts
from spec.runtime.round_plan import PlanInputs, PlanPolicy, RoundPlan, plan_round
from spec.runtime.state import SpecRequestState
from spec.runtime.step_planner import StepPlanner
from spec.runtime.tree import TreeShape

K = 3
MAX_KEPT = 4


def _catch_up() -> DraftCatchUp:
    # A draft input as wide as MAX_KEPT rows fill KEPT_HIDDEN_BYTES (one byte an element);
    # no catch-up runs here, so no extender.
    catch_up = DraftCatchUp(None, KEPT_HIDDEN_BYTES // MAX_KEPT, 1)  # type: ignore[arg-type]
    assert catch_up.max_kept == MAX_KEPT
    return catch_up


def _request(i: int, max_tokens: int, speculates: bool) -> Request:
    req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    req.num_draft_tokens = K if speculates else 0
    # Its draft current: every depth holds the prompt up to its newest token.
    seqs = [DraftSeq(valid_len=2) for _ in range(K)]
    req.spec_state = SpecRequestState(seqs, [None] * (K - 1)) if speculates else None
    return req


def _planner(catch_up: DraftCatchUp, policy: PlanPolicy) -> StepPlanner:
    # Each plan here is plain or catches up: no verify path is surveyed.
    shape = TreeShape.chains(1, K)
    return StepPlanner(policy, K, shape, None, 64, catch_up, lambda req: shape)  # type: ignore[arg-type]


def _plain_step(catch_up: DraftCatchUp, requests: list[Request]) -> None:
    for req in requests:
        req.commit(7)
        if len(req.output_token_ids) >= req.params.max_tokens:
            req.finish_reason = "length"
    catch_up.keep(requests, torch.zeros(len(requests), 1))


def _walked(requests: list[Request], max_kept: int, policy: PlanPolicy) -> RoundPlan:
    """plan_round's plan from inputs gathered request by request, as a planner once did."""
    behind = [
        req for req in requests if req.spec_state and req.spec_state.kept_hidden and req.lookahead
    ]

    def never(path: str) -> bool:
        raise AssertionError(f"a plain step surveyed {path}")

    inputs = PlanInputs(
        batch_size=len(requests),
        kind="chain",
        num_drafts=K,
        drafting=any(
            req.lookahead and req.spec_state is not None and not req.spec_state.kept_hidden
            for req in requests
        ),
        behind=len(behind),
        pending_positions=sum(len(req.spec_state.kept_hidden) for req in behind),
        over_cap=any(len(req.spec_state.kept_hidden) >= max_kept for req in behind),
        queued="none",
        waiting=False,
        costs=StepCosts().facts(len(requests)),
        feasible=never,
    )
    return plan_round(inputs, policy)


@pytest.mark.parametrize("limit", [1, 6])
def test_plain_steps_are_planned_as_plan_round_plans_them(limit):
    """Requests join, finish, stop speculating near their max_tokens and catch up, over many
    plain steps; each step's plan is the one plan_round makes from a walk over the batch, and
    the catch-up's counts are that walk's."""
    rng = random.Random(limit)
    catch_up = _catch_up()
    # Below the limit, every step with drafts behind catches them up first ("always").
    policy = PlanPolicy("always", disable_batch_size=limit)
    planner = _planner(catch_up, policy)
    requests = [_request(i, rng.randint(2, 12), i % 5 != 4) for i in range(8)]
    labels = set()
    for step in range(60):
        running = [req for req in requests if not req.finished]
        if step == 0:
            # Rounds off from the prompts on: one plain step leaves every draft behind.
            _plain_step(catch_up, running)
        if not running or (len(running) < limit and not catch_up.behind(running).requests):
            break  # the next step would verify drafts
        expected = _walked(running, catch_up.max_kept, policy)
        over_cap = any(
            req.lookahead and req.spec_state and len(req.spec_state.kept_hidden) >= MAX_KEPT
            for req in running
        )
        assert catch_up.behind(running).over_cap == catch_up.over_cap(running) == over_cap
        planned = planner.plan(running, waiting=False, launched=None)
        assert planned is not None
        plan, survey = planned
        assert plan == expected
        assert (survey is None) == (len(running) >= limit)
        labels.add((plan.label, plan.reason))
        _plain_step(catch_up, running)
        if plan.catches_up:
            # What DraftCatchUp.run extends: each request behind, over the rows it kept.
            for item in catch_up.take(running, lambda req: TreeShape.chains(1, K)):
                assert item.target_hidden.shape[0] == item.m - item.embeds_start
                item.state.seqs[0].valid_len = item.m  # as the extend leaves it
        if rng.random() < 0.3:
            requests.append(_request(len(requests), rng.randint(2, 12), True))
    if limit == 1:
        assert ("plain/catch_up", "hidden states kept to the cap") in labels
        assert ("plain", "batch of 1 or more") in labels


def test_a_step_with_nothing_behind_finds_it_in_one_test():
    catch_up = _catch_up()
    speculating, alone = _request(0, 10, True), _request(1, 10, False)
    assert catch_up.behind([alone, speculating]).drafting
    assert not catch_up.behind([alone]).drafting
    catch_up.keep([alone, speculating], torch.zeros(2, 1))
    walk = catch_up.behind([alone, speculating])
    assert (walk.requests, walk.positions, walk.drafting) == (1, 1, False)
    assert speculating.spec_state.kept_hidden[0][1] == 1  # its row of the step's hidden states
    for _ in range(MAX_KEPT - 1):
        assert not catch_up.over_cap([speculating])
        catch_up.keep([speculating], torch.zeros(1, 1))
    assert catch_up.over_cap([speculating]) and catch_up.behind([speculating]).over_cap
    # One token left: that request verifies no drafts, and its cap no longer counts.
    speculating.output_token_ids = [7] * 9
    assert not catch_up.over_cap([speculating]) and not catch_up.behind([speculating]).over_cap
    catch_up.forget(speculating.spec_state)
    assert not catch_up.over_cap([_request(2, 10, True)])
