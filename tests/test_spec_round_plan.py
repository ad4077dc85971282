"""The round plan (spec/runtime/round_plan.py) as a function of its stated inputs, and the costs it
reads (spec/runtime/round_costs.py) as the engine's steps measure them: which verify path a round
takes, when a step is plain, when drafts catch up, and when adaptive speculation pays."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.commands.cli import build_parser
from cluster.commands.cli_commands import engine_args
from engine.env import speculative_plan_default
from engine.loading.loader import EngineArgs
from spec.runtime.round_costs import (
    COST_WINDOW,
    MIN_ACCEPT_SAMPLES,
    MIN_SAMPLES,
    PROBE_SAMPLES,
    StepCosts,
    batch_bucket,
)
from spec.runtime.round_plan import (
    PROBE_EVERY,
    PROBE_NEAR_EVERY,
    CostFacts,
    PlanInputs,
    PlanPolicy,
    RoundPlan,
    plan_round,
)

ALWAYS = PlanPolicy("always")
ADAPTIVE = PlanPolicy("adaptive")


def _inputs(feasible: set[str] = frozenset(), **changes) -> PlanInputs:
    """Four requests drafting chains of 3, nothing queued or behind; `feasible`: the paths
    that can run (each asked at most once)."""
    asked: list[str] = []

    def can_run(path: str) -> bool:
        assert path not in asked, f"{path} asked twice"
        asked.append(path)
        return path in feasible

    base = PlanInputs(
        batch_size=4,
        kind="chain",
        num_drafts=3,
        drafting=True,
        behind=0,
        pending_positions=0,
        over_cap=False,
        queued="none",
        waiting=False,
        costs=CostFacts(),
        feasible=can_run,
    )
    return dataclasses.replace(base, **changes)


def _costs(accept: float | None, plain_s=None, round_s=None, **changes) -> CostFacts:
    return CostFacts(accept, plain_s, round_s, **changes)


@pytest.mark.parametrize(
    "feasible, queued, label",
    [
        ({"queued_by_device", "device", "fixed"}, "by_device", "chain/queued_by_device"),
        ({"queued_by_host", "device"}, "by_host", "chain/queued_by_host"),
        ({"device", "fixed"}, "by_device", "chain/device"),  # the queued one is not theirs
        ({"device"}, "none", "chain/device"),
        ({"fixed"}, "none", "chain/host/fixed"),
        (set(), "none", "chain/host/general"),
    ],
)
def test_a_round_takes_the_first_verify_path_that_can_run(feasible, queued, label):
    plan = plan_round(_inputs(feasible, queued=queued), ALWAYS)
    assert plan.label == label and plan.speculates and plan.num_drafts == 3
    assert plan.extend == ("device" if plan.verify != "host" else label.rpartition("/")[2])
    assert plan.trace_args()["plan"] == label


def test_the_policy_chooses_among_the_paths():
    everything = {"queued_by_device", "device", "fixed"}
    host_only = PlanPolicy("always", device_rounds=False)
    plan = plan_round(_inputs(everything, queued="by_device"), host_only)
    assert plan.label == "chain/host/fixed"
    general = PlanPolicy("always", device_rounds=False, fixed_extend=False)
    assert plan_round(_inputs(everything), general).label == "chain/host/general"
    # Where the next round's verify is queued from.
    assert plan_round(_inputs(everything), ALWAYS).queue_next == "device"
    assert plan_round(_inputs(everything), PlanPolicy("always", queue_next="host")).queue_next == (
        "host"
    )
    # Prompts waiting for admission: the next step may decode other requests.
    assert plan_round(_inputs(everything, waiting=True), ALWAYS).queue_next == "none"
    assert plan_round(_inputs(everything, kind="tree"), ALWAYS).label == "tree/device"


def test_at_the_disable_batch_size_every_step_is_plain():
    policy = PlanPolicy("always", disable_batch_size=4)
    plan = plan_round(_inputs({"device"}), policy)
    assert plan == RoundPlan("plain", reason="batch of 4 or more")
    assert not plan.speculates and plan.label == "plain"
    assert plan_round(_inputs({"device"}, batch_size=3), policy).label == "chain/device"
    with pytest.raises(ValueError, match="disable_batch_size"):
        PlanPolicy(disable_batch_size=0)
    with pytest.raises(ValueError, match="adaptive"):
        PlanPolicy("sometimes")  # type: ignore[arg-type]


def test_steps_with_no_drafts_to_verify_are_plain_unless_their_verify_ran_ahead():
    plan = plan_round(_inputs({"device"}, drafting=False), ALWAYS)
    assert plan.label == "plain" and plan.reason == "no drafts to verify"
    queued = dict(drafting=False, queued="by_host")
    plan = plan_round(_inputs({"queued_by_host"}, **queued), ALWAYS)
    assert plan.label == "chain/queued_by_host" and plan.queue_next == "none"
    # Whatever the costs say: that verify ran already.
    losing = _inputs({"queued_by_host"}, costs=_costs(1.0), **queued)
    assert plan_round(losing, ADAPTIVE).label == "chain/queued_by_host"


def test_drafts_left_behind_catch_up_before_a_round():
    behind = _inputs({"device"}, behind=2, pending_positions=5)
    plan = plan_round(behind, ALWAYS)
    assert plan.label == "plain/catch_up" and plan.catches_up and not plan.speculates
    # Not speculating: they stay behind, until a request keeps as many hidden states as it may.
    off = PlanPolicy("always", disable_batch_size=2)
    assert plan_round(behind, off).label == "plain"
    assert plan_round(dataclasses.replace(behind, over_cap=True), off).label == "plain/catch_up"
    # Behind with nothing else to verify: catching up is what lets them verify again.
    alone = dataclasses.replace(behind, drafting=False)
    assert plan_round(alone, ALWAYS).label == "plain/catch_up"


def test_adaptive_measures_a_round_first_where_the_drafts_are_near():
    assert plan_round(_inputs({"device"}), ADAPTIVE).label == "chain/device"
    far = _inputs({"device"}, behind=4, pending_positions=4 * 100)
    plan = plan_round(far, ADAPTIVE)
    assert plan.label == "plain" and "too far behind" in plan.reason


@pytest.mark.parametrize(
    "accept, speculating, speculates",
    [
        (3.0, True, True),  # 3 tokens a round for the cost of 2 plain steps
        (1.9, True, False),
        (2.05, True, True),  # on: stays on above break-even
        (2.05, False, False),  # off: needs the margin to come back on
        (2.2, False, True),
    ],
)
def test_adaptive_speculates_where_the_accept_length_beats_the_cost(
    accept, speculating, speculates
):
    costs = _costs(accept, plain_s=0.010, round_s=0.020, speculating=speculating)
    plan = plan_round(_inputs({"device"}, costs=costs), ADAPTIVE)
    assert plan.speculates is speculates, plan.reason


def test_an_accept_length_of_one_never_pays_whatever_the_measurement():
    """A round holds a plain step's forward: measured cheaper than one (noise), it still
    does not pay when it commits what a plain step does."""
    costs = _costs(1.0, plain_s=0.020, round_s=0.010)
    plan = plan_round(_inputs({"device"}, costs=costs), ADAPTIVE)
    assert not plan.speculates and "as a plain step does" in plan.reason
    assert not plan_round(_inputs({"device"}, costs=_costs(1.0)), ADAPTIVE).speculates


def test_adaptive_probes_the_kind_it_has_not_run_for_a_while():
    paying = _costs(3.0, 0.010, 0.020, plain_age=PROBE_EVERY)
    plan = plan_round(_inputs({"device"}, costs=paying), ADAPTIVE)
    assert not plan.speculates and "probing" in plan.reason
    losing = _costs(1.5, 0.010, 0.020, round_age=PROBE_EVERY, speculating=False)
    plan = plan_round(_inputs({"device"}, costs=losing), ADAPTIVE)
    assert plan.speculates and "probing" in plan.reason
    # Not where the drafts would first catch up over many positions.
    far = _inputs({"device"}, costs=losing, behind=4, pending_positions=4 * 100)
    assert not plan_round(far, ADAPTIVE).speculates


def test_rounds_off_near_break_even_are_probed_sooner():
    """While rounds are off no round updates the accept length, so one that switched them
    off near break-even (a round costs 2 plain steps here) is probed again after
    PROBE_NEAR_EVERY steps, one far from it only after PROBE_EVERY."""
    near = _costs(1.9, 0.010, 0.020, round_age=PROBE_NEAR_EVERY, speculating=False)
    plan = plan_round(_inputs({"device"}, costs=near), ADAPTIVE)
    assert plan.speculates and "probing" in plan.reason
    far = _costs(1.5, 0.010, 0.020, round_age=PROBE_NEAR_EVERY, speculating=False)
    assert not plan_round(_inputs({"device"}, costs=far), ADAPTIVE).speculates
    sooner = dataclasses.replace(near, round_age=PROBE_NEAR_EVERY - 1)
    assert not plan_round(_inputs({"device"}, costs=sooner), ADAPTIVE).speculates


def test_the_accept_length_is_not_known_after_a_few_unlucky_rounds():
    """Four request-rounds at 1.75 against a break-even of 1.79 once switched a draft that
    accepts 2.05 off for good; the estimate waits for MIN_ACCEPT_SAMPLES request-rounds."""
    costs = StepCosts()
    costs.round_committed(7, 4)
    assert costs.facts(4).accept_length is None
    plan = plan_round(_inputs({"device"}, costs=costs.facts(4)), ADAPTIVE)
    assert plan.speculates and plan.reason == "measuring a round"


def test_a_probe_after_plain_steps_replaces_the_accept_length():
    """Rounds after plain steps are a probe: it goes on (where the drafts are near) until it
    has PROBE_SAMPLES request-rounds, whose mean replaces the accept length that no round
    updated while rounds were off."""
    costs = StepCosts()
    costs.round_committed(MIN_ACCEPT_SAMPLES, MIN_ACCEPT_SAMPLES)  # known: 1.0, off
    costs.step_started(False, False, 4)
    costs.step_done()
    costs.step_started(True, False, 4)
    assert costs.facts(4).probing
    losing = dataclasses.replace(costs.facts(4), plain_s=0.010, round_s=0.020, speculating=True)
    plan = plan_round(_inputs({"device"}, costs=losing), ADAPTIVE)
    assert plan.speculates and "probing" in plan.reason
    for _ in range(PROBE_SAMPLES // 4):
        costs.round_committed(3 * 4, 4)
    assert not costs.facts(4).probing and costs.facts(4).accept_length == pytest.approx(3.0)


def test_adaptive_reads_a_new_batch_size_from_the_ones_measured_around_it():
    """A round's cost over a plain step's grows with the batch: one that did not pay at a
    smaller batch does not here, one that paid at a larger batch does."""
    below = _costs(2.0, round_s=0.02, ratio_below=2.5)
    assert not plan_round(_inputs({"device"}, costs=below), ADAPTIVE).speculates
    above = _costs(2.0, round_s=0.02, ratio_above=1.5)
    assert plan_round(_inputs({"device"}, costs=above), ADAPTIVE).speculates
    # Neither known: the round measured, a plain step next.
    plan = plan_round(_inputs({"device"}, costs=_costs(2.0, round_s=0.02)), ADAPTIVE)
    assert not plan.speculates and plan.reason == "measuring a plain step"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(costs: StepCosts, clock: _Clock, speculates: bool, seconds: float, n: int, batch=4):
    for _ in range(n):
        costs.step_started(speculates, False, batch)
        clock.now += seconds
        costs.step_done()


def test_step_costs_measure_steady_steps_of_each_kind_by_batch_bucket():
    clock = _Clock()
    costs = StepCosts(clock)
    # The first step of a kind pays for the change: never measured.
    _steps(costs, clock, True, 0.5, 1)
    _steps(costs, clock, True, 0.020, MIN_SAMPLES)
    facts = costs.facts(4)
    assert facts.round_s == pytest.approx(0.020) and facts.plain_s is None
    _steps(costs, clock, False, 0.5, 1)
    _steps(costs, clock, False, 0.010, MIN_SAMPLES - 1)
    assert costs.facts(4).plain_s is None
    _steps(costs, clock, False, 0.010, 1)
    facts = costs.facts(3)  # the same bucket
    assert facts.plain_s == pytest.approx(0.010) and facts.round_age == MIN_SAMPLES + 1
    assert not facts.speculating
    # A bucket measured on both sides tells its neighbours the ratio.
    assert batch_bucket(3) == 4 and batch_bucket(5) == 8 and batch_bucket(1) == 1
    assert costs.facts(8).ratio_below == pytest.approx(2.0)
    assert costs.facts(2).ratio_above == pytest.approx(2.0)


def test_a_step_costs_the_time_from_the_last_steps_end_to_its_own():
    """With overlap scheduling and verifies queued on the device, a step's own host time is
    mostly launches and the device's work is waited for between steps: both count."""
    clock = _Clock()
    costs = StepCosts(clock)
    for _ in range(1 + MIN_SAMPLES):
        clock.now += 0.009  # the wait for the device before the next plan
        costs.step_started(True, False, 64)
        clock.now += 0.001
        costs.step_done()
    assert costs.facts(64).round_s == pytest.approx(0.010)
    costs.interrupted()  # the gap around a prefill is no step's cost
    clock.now += 5.0
    _steps(costs, clock, True, 0.001, 1, batch=64)
    clock.now += 0.003
    _steps(costs, clock, True, 0.001, COST_WINDOW, batch=64)
    assert costs.facts(64).round_s == pytest.approx(0.001)


def test_a_stalled_step_does_not_move_the_cost():
    """The host stalls one step for fifty times its length: the cost stays the usual
    step's, and the stall is forgotten after COST_WINDOW steps however many there are."""
    clock = _Clock()
    costs = StepCosts(clock)
    _steps(costs, clock, False, 0.010, 1 + MIN_SAMPLES)
    _steps(costs, clock, False, 0.500, 1)
    _steps(costs, clock, False, 0.010, 1)
    assert costs.facts(4).plain_s == pytest.approx(0.010)
    _steps(costs, clock, False, 0.020, COST_WINDOW)
    assert costs.facts(4).plain_s == pytest.approx(0.020)


def test_steps_after_something_else_ran_or_that_catch_up_are_not_measured():
    clock = _Clock()
    costs = StepCosts(clock)
    _steps(costs, clock, False, 0.010, 1)
    costs.interrupted()  # a prefill ran in between
    _steps(costs, clock, False, 0.5, 1)
    costs.step_started(False, True, 4)  # a catch-up
    clock.now += 0.5
    costs.step_done()
    _steps(costs, clock, False, 0.010, 1)  # after the catch-up: not steady yet
    assert costs.facts(4).plain_s is None
    _steps(costs, clock, False, 0.010, MIN_SAMPLES)
    assert costs.facts(4).plain_s == pytest.approx(0.010)


def test_the_accept_length_is_known_after_a_few_rounds_of_requests():
    costs = StepCosts()
    costs.round_committed(4, 1)
    assert costs.facts(1).accept_length is None
    costs.round_committed(2 * (MIN_ACCEPT_SAMPLES - 1), MIN_ACCEPT_SAMPLES - 1)
    mean = (4 + 2 * (MIN_ACCEPT_SAMPLES - 1)) / MIN_ACCEPT_SAMPLES
    assert costs.facts(1).accept_length == pytest.approx(mean)
    costs.round_committed(0, 0)  # a round where no request verified drafts
    assert costs.facts(1).accept_length == pytest.approx(mean)
    for _ in range(200):
        costs.round_committed(16, 16)
    assert costs.facts(1).accept_length == pytest.approx(1.0, abs=1e-6)


def test_a_round_weighs_in_the_accept_length_by_its_requests():
    """A lone request's round (its accepted count swings from 1 to K+1) moves the running
    accept length far less than a batch's round, an average over many requests; so the
    last rounds of a thinned batch do not switch speculation off at a larger batch."""
    costs = StepCosts()
    costs.round_committed(2 * MIN_ACCEPT_SAMPLES, MIN_ACCEPT_SAMPLES)
    assert costs.facts(16).accept_length == pytest.approx(2.0)
    for _ in range(4):  # four unlucky rounds of one request: nothing accepted
        costs.round_committed(1, 1)
    assert costs.facts(16).accept_length > 1.95
    costs.round_committed(16, 16)  # one batch's round with nothing accepted
    assert costs.facts(16).accept_length < 1.9


def test_fixed_costs_stay_whatever_the_steps_take():
    clock = _Clock()
    costs = StepCosts.fixed(plain_s=1.0, round_s=2.0)
    costs.clock = clock
    for speculates in (True, True, True, False, False, False):
        _steps(costs, clock, speculates, 5.0, 1, batch=8)
    for batch in (1, 8, 64):
        facts = costs.facts(batch)
        assert (facts.plain_s, facts.round_s) == (1.0, 2.0) and not facts.speculating


def test_the_plan_flags_reach_the_engine_and_bad_values_are_refused(capsys):
    spec = ["--speculative-algorithm", "multi-layer-eagle"]
    flags = [*spec, "--speculative-plan", "always", "--speculative-disable-batch-size", "32"]
    args = engine_args(build_parser().parse_args(["serve", *flags]))
    assert (args.speculative_plan, args.speculative_disable_batch_size) == ("always", 32)
    plain = engine_args(build_parser().parse_args(["serve", *spec]))
    assert (plain.speculative_plan, plain.speculative_disable_batch_size) == (None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *spec, "--speculative-plan", "never"])
    assert "invalid choice: 'never'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="speculative_disable_batch_size must be >= 1"):
        EngineArgs(speculative_algorithm="multi-layer-eagle", speculative_disable_batch_size=0)
    with pytest.raises(ValueError, match="need a speculative_algorithm"):
        EngineArgs(speculative_plan="always")
    # Unset, the plan is the environment's, else adaptive.
    assert speculative_plan_default({}) == "adaptive"
    assert speculative_plan_default({"PDCLUSTER_SPECULATIVE_PLAN": "always"}) == "always"
