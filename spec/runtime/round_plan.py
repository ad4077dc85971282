"""The round plan: what one decode step of a speculating engine runs, decided once per step by
`plan_round` from stated inputs, then carried out as it says (spec.runtime.worker,
spec.runtime.round_verify and spec.runtime.round_extend for the rounds, engine.speculative_steps for
plain steps).

A plan is one of:
- plain: every request decodes one token, as without speculation. A request's draft then
  falls one position behind; the target's hidden state at that position is kept
  (`SpecRequestState.kept_hidden`), so that the draft can catch up over those positions
  without a prefill. A plain plan that catches up (`extend == "general"`) runs the general
  draft extend over them after its tokens are committed: the next step may verify again.
- a chain of K drafts, or a tree of the engine's shape (spec/runtime/tree.py), with where its verify
  comes from: queued behind the last round by the device or by the host, run now for a round
  decided on the device (spec/runtime/device_round.py, spec/runtime/tree_round.py), or run now for
  the host's round (spec/runtime/host_verify.py); and which draft extend follows: the one queued in
  the device round, the fixed-shape one (spec/runtime/decode_extend.py) or the general one.

Whether a step speculates: only where some request has drafts to verify (or to catch up), or
its verify was queued behind the last round (it ran already: taking it costs less than a plain
forward); never at or above `PlanPolicy.disable_batch_size` requests; always where the policy
says "always"; otherwise where a round is expected to commit more tokens a second than a plain
step at this batch size: the running accept length (tokens a request commits per round)
against the measured cost of a round over a plain step (spec.runtime.round_costs, learned online),
which is never taken below 1 (a round's verify holds a plain step's forward). Which verify
path a round takes is the first, in the order above, that can run for the step's requests
(`PlanInputs.feasible`, which the worker answers from what the requests hold, their sampling
and what the graphs hold)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

PlanKind = Literal["plain", "chain", "tree"]
VerifyPath = Literal["none", "queued_by_device", "queued_by_host", "device", "host"]
ExtendPath = Literal["none", "device", "fixed", "general"]
QueueNext = Literal["none", "host", "device"]
Queued = Literal["none", "by_device", "by_host"]

# The accept length must beat a round's cost over a plain step's by this much before a plain
# engine turns speculation on (and by nothing to keep it on): measurements that hover around
# the break-even point do not flip the plan every few steps, each flip costing a catch-up.
SWITCH_ON_MARGIN = 1.05
# A measured cost is refreshed after this many steps at its batch size of the other kind.
PROBE_EVERY = 512
# Rounds off with an accept length within this share of break-even are probed again after
# PROBE_NEAR_EVERY steps instead: while off, no round updates the accept length, and one
# that hovers near break-even is as likely to pay on the text being written now.
NEAR_BREAK_EVEN = 0.9
PROBE_NEAR_EVERY = 64
# Positions a request's draft may be behind, on average over the batch, for a step to calibrate
# or probe rounds: catching up runs every depth over all of them, too dear to spend on a
# measurement beyond the steps between two probes near break-even.
CALIBRATION_CATCH_UP = PROBE_NEAR_EVERY


@dataclass(frozen=True)
class PlanPolicy:
    """How plans are chosen (EngineConfig's speculative options, or a test's choice of path).
    `speculation`: "adaptive" speculates where it pays, "always" wherever some request has
    drafts to verify. `disable_batch_size`: at this many requests or more, every step is plain.
    `device_rounds`: rounds may be decided on the device (False: the host's round always);
    `fixed_extend`: the host's round may take the fixed-shape extend; `queue_next`: a round on
    the device queues the next round's verify behind it ("device": from the device where its
    graph and slots allow, from the host otherwise; "host": from the host; "none")."""

    speculation: Literal["adaptive", "always"] = "adaptive"
    disable_batch_size: int | None = None
    device_rounds: bool = True
    fixed_extend: bool = True
    queue_next: QueueNext = "device"

    def __post_init__(self) -> None:
        if self.speculation not in ("adaptive", "always"):
            raise ValueError(
                f"speculation must be 'adaptive' or 'always', got {self.speculation!r}"
            )
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ValueError(f"disable_batch_size must be >= 1, got {self.disable_batch_size}")


@dataclass(frozen=True)
class RoundPlan:
    """One decode step's plan (see the module's doc). `num_drafts`: K, the drafts a request
    verifies at most (0 for a plain step). `reason`: why the step speculates or not."""

    kind: PlanKind
    num_drafts: int = 0
    verify: VerifyPath = "none"
    extend: ExtendPath = "none"
    queue_next: QueueNext = "none"
    reason: str = ""

    @property
    def speculates(self) -> bool:
        return self.kind != "plain"

    @property
    def catches_up(self) -> bool:
        """A plain step whose requests' drafts catch up after it."""
        return self.kind == "plain" and self.extend != "none"

    @property
    def label(self) -> str:
        """The plan in a few words, what traces and counters name it by: "plain",
        "plain/catch_up", "<kind>/<verify>" for a round on the device ("chain/device",
        "tree/queued_by_device"), "<kind>/host/<extend>" for the host's ("chain/host/fixed")."""
        if self.kind == "plain":
            return "plain/catch_up" if self.catches_up else "plain"
        if self.verify == "host":
            return f"{self.kind}/host/{self.extend}"
        return f"{self.kind}/{self.verify}"

    def trace_args(self) -> dict[str, Any]:
        return {"plan": self.label, "extend": self.extend, "why": self.reason}


@dataclass(frozen=True)
class CostFacts:
    """What the engine measured, at the step's batch size (spec.runtime.round_costs): the running
    accept length (tokens a request commits per round, bonus included), a plain step's and a
    round's seconds (None until measured enough) and how many steps at this batch size ago
    each was last measured; round over plain measured at the nearest smaller and larger batch
    sizes (a round's cost over a plain step's grows with the batch: bounds on this one's),
    whether the engine's last decode step speculated, and whether a probe of rounds after
    plain steps is still gathering the accept length it replaces (`probing`)."""

    accept_length: float | None = None
    plain_s: float | None = None
    round_s: float | None = None
    plain_age: int = 0
    round_age: int = 0
    ratio_below: float | None = None
    ratio_above: float | None = None
    speculating: bool = True
    probing: bool = False


@dataclass(frozen=True)
class PlanInputs:
    """Everything a step's plan is decided from. `drafting`: some request has drafts to verify
    now; `behind`: requests whose draft fell behind over plain steps (they verify nothing
    until it caught up), `pending_positions` their positions to catch up in all, and
    `over_cap` whether some request keeps as many hidden states as it may; `queued`: the verify
    queued behind the last round, when it is of these requests with their tokens; `waiting`:
    prompts wait for admission (the next step may not decode these requests). `feasible(path)`:
    whether the verify path "queued_by_device", "queued_by_host" or "device", or the fixed
    extend ("fixed") after the host's verify, can run for these requests (asked lazily, in the
    order of preference: each answer gathers what that path reads)."""

    batch_size: int
    kind: Literal["chain", "tree"]
    num_drafts: int
    drafting: bool
    behind: int
    pending_positions: int
    over_cap: bool
    queued: Queued
    waiting: bool
    costs: CostFacts
    feasible: Callable[[str], bool]


def plan_round(inputs: PlanInputs, policy: PlanPolicy) -> RoundPlan:
    """The plan of one decode step (see the module's doc)."""
    if past_disable_batch_size(inputs.batch_size, inputs.queued, policy):
        return plain_past_limit(policy, inputs.drafting or inputs.behind > 0, inputs.over_cap)
    if not (inputs.drafting or inputs.behind):
        # Requests with one token left verify no draft; a verify queued for them ran already,
        # and taking it costs less than a plain step's forward.
        queued = _queued_verify(inputs, policy)
        if queued is not None:
            return RoundPlan(
                inputs.kind, inputs.num_drafts, queued, "device", reason="its verify ran ahead"
            )
        return _plain(inputs, "no drafts to verify")
    speculate, reason = _speculation(inputs, policy)
    if not speculate:
        return _plain(inputs, reason)
    if inputs.behind:
        return RoundPlan("plain", extend="general", reason=f"catching up to speculate: {reason}")
    verify: VerifyPath = "host"
    if policy.device_rounds:
        queued = _queued_verify(inputs, policy)
        if queued is not None:
            verify = queued
        elif inputs.feasible("device"):
            verify = "device"
    if verify == "host":
        fixed = policy.fixed_extend and inputs.feasible("fixed")
        extend: ExtendPath = "fixed" if fixed else "general"
        return RoundPlan(inputs.kind, inputs.num_drafts, verify, extend, reason=reason)
    queue_next = "none" if inputs.waiting else policy.queue_next
    return RoundPlan(inputs.kind, inputs.num_drafts, verify, "device", queue_next, reason)


def past_disable_batch_size(batch_size: int, queued: Queued, policy: PlanPolicy) -> bool:
    """Whether `policy.disable_batch_size` alone decides the plan of a step of `batch_size`
    requests (`plain_past_limit`): at that many requests or more with no verify queued for
    them (one that is, which ran already, may still be taken). Such a step's plan reads
    neither the costs nor the verify paths, nor which requests are behind, only the two
    answers `plain_past_limit` takes: a plain step's planning costs no walk over the batch
    beyond those."""
    limit = policy.disable_batch_size
    return queued == "none" and limit is not None and batch_size >= limit


def plain_past_limit(policy: PlanPolicy, has_drafts: bool, over_cap: bool) -> RoundPlan:
    """The plan of a step that `past_disable_batch_size` says the limit decides: plain (and
    catching up where some request keeps as many hidden states as it may); `has_drafts`:
    some request may verify drafts (has them now, or behind)."""
    if over_cap:
        return RoundPlan("plain", extend="general", reason="hidden states kept to the cap")
    if not has_drafts:
        return RoundPlan("plain", reason="no drafts to verify")
    return RoundPlan("plain", reason=f"batch of {policy.disable_batch_size} or more")


def _plain(inputs: PlanInputs, reason: str) -> RoundPlan:
    """A plain step; its drafts catch up after it where some request keeps as many hidden
    states as it may."""
    if inputs.over_cap:
        return RoundPlan("plain", extend="general", reason="hidden states kept to the cap")
    return RoundPlan("plain", reason=reason)


def _queued_verify(inputs: PlanInputs, policy: PlanPolicy) -> VerifyPath | None:
    """The verify queued behind the last round, where this step can take it."""
    if not policy.device_rounds or inputs.queued == "none":
        return None
    if not inputs.feasible(f"queued_{inputs.queued}"):
        return None
    return "queued_by_device" if inputs.queued == "by_device" else "queued_by_host"


def _speculation(inputs: PlanInputs, policy: PlanPolicy) -> tuple[bool, str]:
    """Whether a step with drafts to verify (or drafts to catch up) speculates, and why."""
    limit = policy.disable_batch_size
    if limit is not None and inputs.batch_size >= limit:
        return False, f"batch of {limit} or more"
    if policy.speculation == "always":
        return True, "always"
    cheap = inputs.pending_positions <= CALIBRATION_CATCH_UP * inputs.batch_size
    return _pays(inputs.costs, cheap)


def _pays(costs: CostFacts, cheap: bool) -> tuple[bool, str]:
    """The adaptive choice from the measured costs; `cheap`: the drafts are close enough to
    current for a round to be run just to measure it."""
    accept = costs.accept_length
    if accept is None:
        return _measure_round(cheap)
    # A round's verify is a plain step's forward with drafts beside each newest token, and
    # its extend comes on top: it never costs less than a plain step, whatever a noisy
    # measurement says, so an accept length of 1 never pays.
    if accept <= 1.0:
        return _not_paying(costs, cheap, f"accepts {accept:.2f} a round, as a plain step does")
    margin = 1.0 if costs.speculating else SWITCH_ON_MARGIN
    if costs.plain_s is not None and costs.round_s is not None:
        ratio = max(1.0, costs.round_s / costs.plain_s)
        why = f"accepts {accept:.2f} a round costing {ratio:.2f} plain steps"
        if accept >= ratio * margin:
            if costs.plain_age >= PROBE_EVERY:
                return False, "probing a plain step's cost"
            return True, why
        return _not_paying(costs, cheap, why, near=accept >= ratio * NEAR_BREAK_EVEN)
    # A round's cost over a plain step's grows with the batch.
    if costs.ratio_below is not None and accept < costs.ratio_below:
        return False, "does not pay at a smaller batch"
    if costs.ratio_above is not None and accept >= costs.ratio_above * margin:
        return True, "pays at a larger batch"
    if costs.round_s is None:
        return _measure_round(cheap)
    return False, "measuring a plain step"


def _not_paying(costs: CostFacts, cheap: bool, why: str, near: bool = False) -> tuple[bool, str]:
    """Plain, except for a round now and then that measures again what rounds commit and
    cost (the text, and with it the accept length, changes); sooner where the accept length
    is `near` break-even. A probe goes on until it has gathered what it measures."""
    if costs.probing and cheap:
        return True, "probing what rounds accept"
    if costs.round_age >= (PROBE_NEAR_EVERY if near else PROBE_EVERY) and cheap:
        return True, "probing a round's cost"
    return False, why


def _measure_round(cheap: bool) -> tuple[bool, str]:
    if cheap:
        return True, "measuring a round"
    return False, "drafts too far behind to measure a round"
