"""The speculator's part of the engine's steps: the draft extend over freshly prefilled
prompts (with each parallel sample pointed at the prompt it shares), and the decode step of
speculating requests, which runs the plan the speculator chose for it (spec/runtime/round_plan.py):
a speculative round (verify each request's draft, commit the accepted tokens, extend the draft
over them), or a plain step (the forward and sampling of a plain engine's decode step, keeping
the target's hidden states for the drafts to catch up over). Where the engine overlaps its
plain steps (engine.executor.overlap) and the requests' sampling allows, a plain step is launched as
a plain engine's is, and so are the plain steps after it that their plans choose
(`plain_plan`, `launched`): a speculating engine's plain step then costs what a plain
engine's does, and the round plan weighs rounds against that cost.

The speculator is spec.MultiLayerEagleWorker, handed in by whoever builds the engine: engine
never imports spec, which depends on it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.engine_hooks import QueuedWork, Speculator, StepPlan
from engine.executor.model_runner import ForwardOutput, ModelRunner
from engine.executor.overlap import OverlapDecoder
from engine.executor.prompt_embeds import InputEmbeds
from engine.request import Request
from engine.sampling.step_sampling import decode_plainly, samples_from_logits_alone
from engine.sampling.stopping import StopChecker
from engine.scheduling.prefill_chunks import HeldChunks
from engine.scheduling.scheduler import ScheduledBatch, Scheduler
from engine.tracing import set_correct_drafts, set_time_batch

# What the draft extend for prefill reads of a request: the target's hidden states and input
# rows over its prompt, and the request whose prompt it is another parallel sample of (None).
PromptForDraft = tuple[Request, torch.Tensor, InputEmbeds | None, Request | None]

# Ends `requests` after a failed forward of the given stage; returns the requests it ended.
FailBatch = Callable[[list[Request], str, Exception], list[Request]]


def _drafts(req: Request) -> bool:
    """This decode step verifies draft tokens for `req` (before its tokens are committed)."""
    return req.lookahead > 0


def _decodes_plainly(req: Request) -> bool:
    return req.lookahead == 0


def _extends(req: Request) -> bool:
    """finish_round extends the draft of `req` (after this step's tokens were committed)."""
    return not req.finished and req.lookahead > 0


def _never(req: Request) -> bool:
    return False


class SpeculativeSteps:
    def __init__(
        self,
        speculator: Speculator,
        runner: ModelRunner,
        scheduler: Scheduler,
        stop_checker: StopChecker | None,
        fail: FailBatch,
    ) -> None:
        self.speculator = speculator
        self.runner = runner
        self.scheduler = scheduler
        self.stop_checker = stop_checker
        self.fail = fail
        self.eos_token_ids = tuple(runner.model_config.eos_token_ids)
        # Decode steps by their plan's label (`StepPlan.label`) since the engine started: a
        # node's stats and /metrics report them (`plan_counts`).
        self.plans: dict[str, int] = {}
        # Requests a decode step finished while the next verify, queued on the device behind
        # it, may still write their KV: their slots are freed once it has run (`release_held`).
        self.held: list[Request] = []
        self.held_by: QueuedWork | None = None

    def release_held(self, wait: bool) -> None:
        """Free the slots of the requests held for a queued verify: once it has run, or now
        after waiting for it with `wait`."""
        if self.held_by is None:
            return
        if not wait and not self.held_by.done():
            return
        self.held_by.settle()
        held, self.held, self.held_by = self.held, [], None
        for req in held:
            self.scheduler.release(req)

    # --- after a prefill forward ---
    def prompts_for_draft(
        self, batch: ScheduledBatch, extend_lens: list[int], output: ForwardOutput
    ) -> list[PromptForDraft]:
        """For each request that speculates: holds a chunk's hidden states and input rows until
        its prompt completes; returns, for those whose prompt completes now and the parallel
        samples that share their prompt, the whole prompt's."""
        assert output.hidden is not None
        embeds = output.input_embeds
        per_request = embeds.split(extend_lens) if embeds else [None] * len(extend_lens)
        hidden = output.hidden.split(extend_lens)
        complete: list[PromptForDraft] = []
        for req, done, h, e in zip(batch.requests, batch.completes(), hidden, per_request):
            if not req.num_draft_tokens:
                continue
            if not done:
                req.held_chunks = req.held_chunks or HeldChunks()
                req.held_chunks.add(h, e)
                continue
            if req.held_chunks is not None:
                h, e = req.held_chunks.join(h, e)
                req.held_chunks = None
            complete.append((req, h, e, None))
        rows = {id(req): (h, e) for req, h, e, _ in complete}
        complete += [
            (fork, *rows[id(source)], source) for fork, source in batch.forks if id(source) in rows
        ]
        return complete

    def draft_extend_prefill(self, prompts: list[PromptForDraft]) -> list[Request]:
        """Returns the requests it failed."""
        items = [
            item
            for item in prompts
            # No chain is worth drafting for a request that has one token left to emit.
            if not item[0].finished and item[0].lookahead
        ]
        for req, _, _, _ in prompts:
            if not req.finished and not req.lookahead and req.spec_state is not None:
                # A cached prefix's draft state (spec/runtime/prefix_drafts.py) that no chain
                # follows.
                self.speculator.release(req)
        if not items:
            return []
        requests = [req for req, _, _, _ in items]
        # The parallel samples of a prompt share the draft KV of the first of them drafted.
        first_of: dict[int, int] = {}
        sources = []
        for i, (req, _, _, sampled_from) in enumerate(items):
            prompt = id(sampled_from or req)
            sources.append(first_of.get(prompt))
            first_of.setdefault(prompt, i)
        set_time_batch(requests, "draft_extend_start")
        try:
            self.speculator.draft_extend_prefill(
                requests, [h for _, h, _, _ in items], [e for _, _, e, _ in items], sources
            )
        except Exception as err:  # noqa: BLE001 - a failed draft ends its requests only
            return self.fail(requests, "draft extend (prefill)", err)
        set_time_batch(requests, "draft_extend_end")
        kv_cache = self.scheduler.kv_cache
        if kv_cache.companion is not None:
            # The prompts' draft KV exists now: the prefix cache can take what it covers.
            for req in requests:
                kv_cache.cache_prefix(req)
        return []

    # --- a decode step ---
    def decode(
        self,
        batch: ScheduledBatch,
        default_generator: torch.Generator,
        overlap: OverlapDecoder | None = None,
    ) -> list[Request]:
        """One decode step of the running requests, as the speculator's plan for it says: a
        speculative round (verify, commit, draft extend), or a plain step, launched by
        `overlap` where it can be (its tokens read after the next step is launched)."""
        requests = batch.requests
        # With nothing waiting for admission, the next step decodes those of these requests
        # that are still running (or something changes in between, which its plan sees).
        plan = self.speculator.plan(requests, bool(self.scheduler.waiting))
        self._count(plan)
        if not plan.speculates:
            if overlap is not None and not plan.catches_up:
                if all(samples_from_logits_alone(req) for req in requests):
                    return self._launch_plain(batch, plan, overlap)
            return self._plain(batch, plan, default_generator)
        # The chain this step verifies already exists (drafted by the last draft extend, or by
        # the draft extend for prefill): its draft span is empty. docs/architecture.md, Tracing.
        args = plan.trace_args() if requests[0].trace is not None else None
        set_time_batch(
            requests, "draft_start", "draft_end", "verify_start", where=_drafts, args=args
        )
        set_time_batch(requests, "decode_start", where=_decodes_plainly, args=args)
        try:
            verified = self.speculator.verify(requests, default_generator, plan)
        except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
            self.release_held(wait=True)
            return self.fail(requests, "verify", err)
        # The verify's outcome was read: everything queued before it has run.
        self.release_held(wait=True)
        set_time_batch(requests, "verify_end", where=_drafts)
        set_time_batch(requests, "decode_end", where=_decodes_plainly)
        queued = self.speculator.queued_verify()
        finished = self.scheduler.process_tokens(
            batch, verified.tokens, verified.logprobs, self.stop_checker, queued is not None
        )
        if queued is not None and finished:
            self.held, self.held_by = finished, queued
            if not self.scheduler.running:  # nothing runs after them to hide the wait behind
                self.release_held(wait=True)
        set_time_batch(requests, "draft_extend_start", where=_extends)
        try:
            self.speculator.finish_round(requests, verified, plan)
        except Exception as err:  # noqa: BLE001 - a failed draft ends its requests only
            alive = [req for req in requests if not req.finished]
            return finished + self.fail(alive, "draft extend", err)
        set_time_batch(requests, "draft_extend_end", where=_extends)
        set_correct_drafts(requests)
        return finished

    def _plain(
        self, batch: ScheduledBatch, plan: StepPlan, default_generator: torch.Generator
    ) -> list[Request]:
        """A step that verifies no draft: the forward and sampling of a plain engine's decode
        step, keeping the target's hidden states for the drafts to catch up over later
        (`Speculator.after_plain_step`), which they do after it where the plan says so."""
        requests = batch.requests
        args = plan.trace_args() if requests[0].trace is not None else None
        set_time_batch(requests, "decode_start", args=args)
        try:
            output, token_ids, logprobs = decode_plainly(
                self.runner, requests, self.eos_token_ids, default_generator, keep_hidden=True
            )
        except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
            self.release_held(wait=True)
            return self.fail(requests, "decode", err)
        # The tokens were read: everything queued before this step has run.
        self.release_held(wait=True)
        finished = self.scheduler.process_result(batch, token_ids, logprobs, self.stop_checker)
        set_time_batch(requests, "decode_end")
        extending = _extends if plan.catches_up else _never
        set_time_batch(requests, "draft_extend_start", where=extending)
        try:
            self.speculator.after_plain_step(requests, output.hidden, plan)
        except Exception as err:  # noqa: BLE001 - a failed draft ends its requests only
            alive = [req for req in requests if not req.finished]
            return finished + self.fail(alive, "draft extend", err)
        set_time_batch(requests, "draft_extend_end", where=extending)
        return finished

    def _launch_plain(
        self, batch: ScheduledBatch, plan: StepPlan, overlap: OverlapDecoder
    ) -> list[Request]:
        """A plain step launched by `overlap`: its tokens are read once the next step is on
        its way (engine.executor.overlap), or when the next step's plan is not a plain one."""
        requests = batch.requests
        try:
            overlap.launch(requests, self.runner.build_batch(requests), plan=plan)
        except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
            self.release_held(wait=True)
            return self.fail(requests, "decode", err)
        return []

    # --- plain steps launched while the step before is in flight (engine.executor.overlap) ---
    def plain_plan(self, requests: list[Request], waiting: bool) -> StepPlan | None:
        plan = self.speculator.plain_plan(requests, waiting)
        if plan is not None:
            self._count(plan)
        return plan

    def launched(self, requests: list[Request], hidden: torch.Tensor, plan: StepPlan) -> None:
        # The hidden states are kept where they are: the drafts read them when they catch up,
        # after the step has been read.
        self.speculator.after_plain_step(requests, hidden, plan)

    def _count(self, plan: StepPlan) -> None:
        label = plan.label
        self.plans[label] = self.plans.get(label, 0) + 1
