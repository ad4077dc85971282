"""What a speculative round and a plain step cost at each batch size, and how many tokens a
request commits a round: the measured inputs of the adaptive round plan (spec.runtime.round_plan).

Learned online, from the engine's own decode steps, rather than calibrated at start-up: what a
round costs against a plain step depends on the device, the model, the batch size, the
verify path (graphs, a round decided on the device or the host's) and what else the node does
between steps, and what a round commits depends on the draft and on the text being written;
only the running engine sees all of these, and a start-up calibration would lengthen every
start and still not know the accept length. A step's cost is the wall time from the end of the
engine's previous decode step to the end of this one (its draft extend included), the median of
the last few per batch-size bucket (powers of two) and kind (plain or round). Not the time from
its plan to its end: with overlap scheduling and verifies queued on the device, a step's own
host time is mostly kernel launches, and the device's work surfaces as waits elsewhere in the
engine's loop (where the next step reads its tokens); the time between two steps' ends holds
both, which is what tokens/s sees. A plain step that the engine launches ahead (overlap
scheduling, engine.executor.overlap) ends when it is launched: in a run of them, each engine step
launches one and reads the one before, so the time from one launch to the next is what a plain
engine's overlapped step takes, and that is what a round is weighed against. A step right after
a change of kind or bucket, after a prefill, or that catches drafts up is not measured (it pays
for the transition, not the steady state). The first steps at a bucket measure what is missing
(rounds first, then plain steps), unless a round's cost over a plain step measured at a smaller
batch already rules speculation out, or one measured at a larger batch already rules it in
(that cost ratio grows with the batch)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

from spec.runtime.round_plan import CostFacts

# Measured steps of a kind at a bucket before its cost counts as known, and the most recent
# ones whose median is the cost: a host shared with other work stalls a step now and then for
# many times its length, which would drag an average for many steps after it.
MIN_SAMPLES = 3
COST_WINDOW = 9
# Rounds of a request (summed over the batch) before the accept length counts as known: one
# request's round commits anything from 1 to K+1 tokens, and a good draft's unlucky first
# rounds must not switch speculation off (once off, no round updates the estimate until a
# probe: four request-rounds at 1.75 against a break-even of 1.79 kept a draft that accepts
# 2.05 off).
MIN_ACCEPT_SAMPLES = 32
# Request-rounds a probe (rounds after plain steps) gathers; their mean replaces the accept
# length, which no round updated while rounds were off.
PROBE_SAMPLES = 16
# The weight of one request's round in the accept length's average; a round of n requests
# weighs as n of them (1 - (1 - w)^n: 0.15 at 16 requests, 0.01 at one). Weighing each round
# alike let the last few rounds of a batch that has thinned to one or two requests, whose
# accepted count alone swings from 1 to K+1, pull the average under the break-even point and
# switch speculation off; once off, no round updates it again until a probe.
ACCEPT_WEIGHT = 0.01


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: the batch sizes whose costs are kept together."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class Measured:
    """One kind's cost at one bucket: the median of its last COST_WINDOW measured steps, and the
    bucket's step count at the last one."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    at_step: int = 0
    # The median of `recent`, until the next `add`: every step's plan reads it, one in
    # several measures a step.
    _median: float | None = field(default=None, repr=False)

    @property
    def known(self) -> bool:
        return len(self.recent) >= MIN_SAMPLES

    @property
    def seconds(self) -> float:
        if self._median is None:
            self._median = median(self.recent)
        return self._median

    def add(self, seconds: float, step: int) -> None:
        self.recent.append(seconds)
        self.at_step = step
        self._median = None


class StepCosts:
    """The decode steps' costs and the running accept length of one engine. The worker calls
    `step_started` with each step's plan, `step_done` at its end, `round_committed` after each
    round and `interrupted` when something other than decode steps ran in between.
    `StepCosts.fixed` gives costs that no measurement changes (tests, or a deployment that
    knows them)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.plain: dict[int, Measured] = {}
        self.round: dict[int, Measured] = {}
        self.steps: dict[int, int] = {}  # decode steps seen at each bucket
        # The running accept length: the mean of the first rounds, then an average that
        # forgets (the text being written changes what a draft gets right).
        self.accept_length: float | None = None
        self._accept_tokens = 0
        self._accept_rounds = 0
        self.speculating = True  # what the last step did (a new engine starts speculating)
        # A probe's (tokens, request-rounds) so far, while it gathers PROBE_SAMPLES of them.
        self._probe: tuple[int, int] | None = None
        self._fixed: tuple[float, float] | None = None
        # The step running: (speculates, bucket, the end of the step before it where this one
        # is measured); the last one's kind and bucket, and when it ended.
        self._running: tuple[bool, int, float | None] | None = None
        self._last: tuple[bool, int] | None = None
        self._last_done: float | None = None

    @classmethod
    def fixed(cls, plain_s: float, round_s: float) -> StepCosts:
        """Costs that every batch size has and no step changes; the accept length is still
        learned from the rounds."""
        costs = cls()
        costs._fixed = (plain_s, round_s)
        return costs

    def facts(self, batch_size: int) -> CostFacts:
        bucket = batch_bucket(batch_size)
        plain, round_ = self.plain.get(bucket), self.round.get(bucket)
        steps = self.steps.get(bucket, 0)
        if self._fixed is not None:
            # Given costs need no probe of a plain step; rounds are still probed for what
            # they accept, which no given cost says.
            plain_s, round_s = self._fixed
            return CostFacts(
                self.accept_length,
                plain_s,
                round_s,
                round_age=steps - round_.at_step if round_ else steps,
                speculating=self.speculating,
                probing=self._probe is not None,
            )
        below = above = None
        if not (plain and plain.known and round_ and round_.known):
            below, above = self._neighbour_ratios(bucket)
        return CostFacts(
            accept_length=self.accept_length,
            plain_s=plain.seconds if plain and plain.known else None,
            round_s=round_.seconds if round_ and round_.known else None,
            plain_age=steps - plain.at_step if plain else steps,
            round_age=steps - round_.at_step if round_ else steps,
            ratio_below=below,
            ratio_above=above,
            speculating=self.speculating,
            probing=self._probe is not None,
        )

    def measured(self, batch_size: int) -> tuple[float | None, float | None]:
        """A plain step's and a round's measured seconds at `batch_size`'s bucket, None where
        not known yet: what the adaptive plan weighs (reported by bench/spec.py)."""
        facts = self.facts(batch_size)
        return facts.plain_s, facts.round_s

    def _neighbour_ratios(self, bucket: int) -> tuple[float | None, float | None]:
        """A round's cost over a plain step's at the nearest measured bucket below and above."""
        below = above = None
        for other in sorted(self.round):
            plain, round_ = self.plain.get(other), self.round[other]
            if not (plain and plain.known and round_.known):
                continue
            ratio = round_.seconds / plain.seconds
            if other < bucket:
                below = ratio
            elif other > bucket and above is None:
                above = ratio
        return below, above

    def step_started(self, speculates: bool, catches_up: bool, batch_size: int) -> None:
        bucket = batch_bucket(batch_size)
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        steady = self._last == (speculates, bucket) and not catches_up
        self._running = (speculates, bucket, self._last_done if steady else None)
        self._last = (speculates, bucket) if not catches_up else None
        if speculates and not self.speculating and self.accept_length is not None:
            self._probe = (0, 0)  # rounds after plain steps: what they accept now
        self.speculating = speculates

    def step_done(self) -> None:
        if self._running is None:
            return
        speculates, bucket, since = self._running
        self._running = None
        now = self._last_done = self.clock()
        if since is None:
            return
        table = self.round if speculates else self.plain
        table.setdefault(bucket, Measured()).add(now - since, self.steps[bucket])

    def round_committed(self, tokens: int, requests: int) -> None:
        """A round committed `tokens` for the `requests` requests that verified drafts in it."""
        if not requests:
            return
        if self._accept_rounds < MIN_ACCEPT_SAMPLES:
            self._accept_tokens += tokens
            self._accept_rounds += requests
            if self._accept_rounds >= MIN_ACCEPT_SAMPLES:
                self.accept_length = self._accept_tokens / self._accept_rounds
            return
        assert self.accept_length is not None
        if self._probe is not None:
            probe_tokens, probe_requests = self._probe[0] + tokens, self._probe[1] + requests
            self._probe = (probe_tokens, probe_requests)
            if probe_requests >= PROBE_SAMPLES:
                self.accept_length = probe_tokens / probe_requests
                self._probe = None
            return
        weight = 1.0 - (1.0 - ACCEPT_WEIGHT) ** requests
        self.accept_length += weight * (tokens / requests - self.accept_length)

    def interrupted(self) -> None:
        """Something else ran since the last decode step (a prefill, requests joining): the
        next step pays for it, and is not measured."""
        self._last = None
        self._last_done = None
