"""Overlap scheduling of plain decode steps: the host prepares and launches step N+1 while the
device still runs step N, and reads step N's tokens only then: one device-to-host copy per
step, queued behind the step and waited for once the next step is on its way. The host's work
between steps (committing tokens, stop checks, detokenizing, streaming, scheduling, filling
the next step's inputs) then hides behind the device's.

Step N+1 reads step N's sampled tokens, which the host has not seen yet: its batch is built
with placeholder tokens and the device copies step N's tokens over them (a future-token map
one step deep). Everything else in the batch (row, position, KV slot) follows on the host
from the committed tokens plus the one in flight. A request that step N finishes by EOS, a
stop token or a stop string has already run once more in step N+1: that token is dropped and
its KV slot freed with the request's others (the device writes it before any later step, in
stream order, can reuse the slot). A request that step N's token must finish by length is
left out of step N+1.

Only steps whose every request samples from its logits alone overlap: penalties and min_tokens
read the token history, a grammar's mask needs the newest token, logprobs are read on the host.
A speculating engine's plain steps (the ones its round plan chooses, spec.runtime.round_plan)
overlap the same way (`PlainStepPlans`): the step launched ahead must be planned a plain step, and
keeps the target's hidden states for the drafts to catch up over later; a step that verifies drafts
or catches them up first waits for the step in flight, as a plain engine's prefill does. A
request that joins the running set with its
KV already cached (from a transfer) joins the next step, its input token known on the host.
Anything else that changes the batch (a prompt to prefill, alone or in a mixed step beside the
running requests, or a retraction) first waits for the step in flight (`flush`), then runs as
without overlap. Prompts that wait for a seat (every one of max_num_seqs taken) change nothing
yet: decode steps go on overlapping, and the step after a request finishes admits them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.engine_hooks import StepPlan
from engine.executor.forward_batch import ForwardBatch, Span
from engine.executor.host_copy import HostCopy, int_tensor
from engine.executor.model_runner import ModelRunner
from engine.request import Request
from engine.sampling.step_sampling import samples_from_logits_alone
from engine.sampling.stopping import StopChecker
from engine.scheduling.kv_cache import KVCacheManager
from engine.scheduling.scheduler import ScheduledBatch, Scheduler
from engine.tracing import set_time_batch

# (logits [B, V], requests, tokens each request has in flight) -> tokens [B] on the device.
SampleOnDevice = Callable[[torch.Tensor, list[Request], list[int]], torch.Tensor]


def overlappable(req: Request) -> bool:
    """Whether `req`'s next token depends on nothing but its logits (see the module's doc)."""
    return req.num_draft_tokens == 0 and samples_from_logits_alone(req)


class PlainStepPlans(Protocol):
    """A speculating engine's plain steps launched ahead (engine.speculative_steps)."""

    def plain_plan(self, requests: list[Request], waiting: bool) -> StepPlan | None:
        """The plan of the step of `requests` about to be launched, where it is a plain step
        that may be (None: the step in flight is read first, then the step planned anew)."""

    def launched(self, requests: list[Request], hidden: torch.Tensor, plan: StepPlan) -> None:
        """The plain step of `requests` was launched; `hidden`: the target's hidden states at
        their newest tokens [n, spec_hidden_size], on the device."""


@dataclass
class StepInFlight:
    """A launched decode step whose tokens the host has not read yet."""

    requests: list[Request]
    tokens: torch.Tensor  # [B] on the device: the next step's input
    host: HostCopy  # of `tokens`


class OverlapDecoder:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        kv_cache: KVCacheManager,
        stop_checker: StopChecker,
        sample: SampleOnDevice,
        plans: PlainStepPlans | None = None,
    ) -> None:
        """`plans`: a speculating engine's (see the module's doc)."""
        self.runner = runner
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.stop_checker = stop_checker
        self.sample = sample
        self.plans = plans
        # A request that joins the running set joins a step in flight where its sampling is
        # one this decoder runs (a speculating engine's runs requests with drafts too).
        self.joins = overlappable if plans is None else samples_from_logits_alone
        self.in_flight: StepInFlight | None = None
        # Requests finished by the last step read, their slots held until the step launched
        # after it (which still ran them) is done on the device: a slot freed earlier could be
        # handed to a KV transfer, which lands on a stream of its own.
        self.finished_in_flight: list[Request] = []
        self.num_overlapped_steps = 0

    def launch(
        self,
        requests: list[Request],
        batch: ForwardBatch,
        in_flight: list[int] | None = None,
        plan: StepPlan | None = None,
    ) -> None:
        """Run `batch` (one token for each of `requests`) and sample, leaving the tokens on the
        device; `in_flight[i]`: tokens request i already has in a step not read yet; `plan`:
        the plain step's plan in a speculating engine."""
        args = plan.trace_args() if plan is not None and requests[0].trace is not None else None
        set_time_batch(requests, "decode_start", args=args)
        output = self.runner.forward(batch, keep_hidden=plan is not None)
        tokens = self.sample(output.logits, requests, in_flight or [0] * len(requests))
        self.in_flight = StepInFlight(requests, tokens, HostCopy(tokens))
        if plan is not None:
            assert self.plans is not None and output.hidden is not None
            self.plans.launched(requests, output.hidden, plan)

    def step(self) -> list[Request] | None:
        """Launch the step after the one in flight, then read that one; returns the requests
        it finished, or None where more than decoding may run next (the caller `flush`es, then
        schedules as usual). Raises when the launch fails, the step before still in flight
        (the caller flushes it, then fails the running requests)."""
        previous = self.in_flight
        assert previous is not None
        live = [req for req in previous.requests if not req.finished]
        # The running set is the step's own, then requests that joined it with their KV (from a
        # transfer, `Scheduler.add_running`), and no waiting prompt has a seat: none retracted
        # or prefilled.
        running = self.scheduler.running
        joined = running[len(live) :]
        if (
            self.scheduler.may_admit()
            or not _same(running[: len(live)], live)
            or not all(self.joins(req) and req.kv_len == req.num_tokens - 1 for req in joined)
        ):
            return None
        going_on = [req for req in live if not self._ends_by_length(req)]
        # A token in flight sits at position num_tokens: the next step writes that slot. A
        # request that joined decodes its newest token, known here, at num_tokens - 1.
        grants = [(req, max(0, req.num_tokens + 1 - len(req.slots))) for req in going_on]
        grants += [(req, max(0, req.num_tokens - len(req.slots))) for req in joined]
        if not (going_on or joined) or not self.kv_cache.can_grow(sum(n for _, n in grants)):
            return None
        plan = None
        if self.plans is not None and any(req.num_draft_tokens for req in going_on + joined):
            plan = self.plans.plain_plan(going_on + joined, bool(self.scheduler.waiting))
            if plan is None:
                return None
        self.kv_cache.grow_many([(req, n) for req, n in grants if n])
        spans = [Span(req.row, req.num_tokens, [0], req.slots[req.num_tokens : req.num_tokens + 1])
                 for req in going_on]  # fmt: skip
        spans += [Span(req.row, req.kv_len, req.token_ids(req.kv_len, req.num_tokens),
                       req.slots[req.kv_len : req.num_tokens]) for req in joined]  # fmt: skip
        batch = self.runner.span_batch(spans)
        source = previous.tokens
        if len(going_on) != len(previous.requests):
            index = {id(req): i for i, req in enumerate(previous.requests)}
            rows = int_tensor([index[id(req)] for req in going_on], source.device)
            source = source.index_select(0, rows)
        # The tokens in flight over their placeholders; the joined requests' were loaded.
        batch.input_ids[: len(going_on)].copy_(source)
        try:
            in_flight = [1] * len(going_on) + [0] * len(joined)
            self.launch(going_on + joined, batch, in_flight, plan)
        except Exception:
            self.in_flight = previous
            raise
        self.num_overlapped_steps += 1
        return self.read(previous)

    def read(self, step: StepInFlight) -> list[Request]:
        """Commit a launched step's tokens (waiting for its copy); returns the requests it
        finished. Requests that ended meanwhile (aborted, finished by the step before) are
        skipped: their token is dropped."""
        tokens = step.host.tolist()
        self._release_finished()
        kept = [(req, t) for req, t in zip(step.requests, tokens) if not req.finished]
        requests = [req for req, _ in kept]
        finished = self.scheduler.process_result(
            ScheduledBatch(requests, is_prefill=False),
            [t for _, t in kept],
            [None] * len(kept),
            self.stop_checker,
            keep_slots=True,
        )
        self.finished_in_flight = finished
        if self.in_flight is None:  # nothing runs on the device any more
            self._release_finished()
        set_time_batch(requests, "decode_end")
        return finished

    def settle(self, request_id: str) -> None:
        """Wait until the step in flight is done on the device if it runs the request
        `request_id` (before its slots are freed, as an abort does)."""
        step = self.in_flight
        if step is not None and any(req.request_id == request_id for req in step.requests):
            step.host.wait()

    def _release_finished(self) -> None:
        for req in self.finished_in_flight:
            self.scheduler.release(req)
        self.finished_in_flight = []

    def flush(self) -> list[Request]:
        """Read the step in flight, if any; returns the requests it finished."""
        step, self.in_flight = self.in_flight, None
        return [] if step is None else self.read(step)

    def _ends_by_length(self, req: Request) -> bool:
        """The token in flight is `req`'s last whatever it is (max_tokens, the context)."""
        return (
            len(req.output_token_ids) + 1 >= req.params.max_tokens
            or req.num_tokens + 1 >= self.stop_checker.max_model_len
        )


def _same(a: list[Request], b: list[Request]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
