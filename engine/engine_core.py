"""One engine step at a time: schedule, forward, sample, process. Shared by `engine.LLM` and
the serving nodes, which drive `step()` from their own loops.

With a speculator (spec.MultiLayerEagleWorker, handed in by whoever builds the engine: engine
never imports spec, which depends on it), a prefill step also runs the draft over the prompt, and
a decode step verifies each request's draft chain, commits the accepted tokens, then extends the
draft over them (engine.speculative_steps).

Without one, a step that admits prompts while requests run is one forward of both (a mixed
step, engine.scheduling.scheduler; `EngineConfig.mixed_prefill`): the running requests decode their
next token in the prompts' forward instead of waiting for it. A speculating engine keeps its steps
apart (a verify step is not mixed), and so does a prefill node, which runs no decode step."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.engine_hooks import PrefillHandoff, Speculator
from engine.executor.model_runner import ModelRunner
from engine.executor.overlap import OverlapDecoder, overlappable
from engine.executor.prompt_embeds import PromptEmbeds
from engine.request import Request, RequestOutput, SpecStats, Usage
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.step_sampling import decode_plainly, sample_next_tokens, sample_overlapped
from engine.sampling.stopping import StopChecker
from engine.scheduling.kv_cache import KVCacheManager
from engine.scheduling.scheduler import ScheduledBatch, Scheduler
from engine.scheduling.step_setup import make_prefix_cache, mixed_step_tokens
from engine.speculative_steps import SpeculativeSteps
from engine.step_counts import StepCounts
from engine.tracing import RequestTrace, set_prefill_end, set_time, set_time_batch
from engine.validation import validate_request

# How long a step with nothing to run waits for a grammar still compiling.
GRAMMAR_WAIT_S = 0.01


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        speculator: Speculator | None = None,
        tracing: bool = False,
        handoff: PrefillHandoff | None = None,
        seed: int | None = None,
        prefix_cache: bool = True,
    ) -> None:
        """`tracing`: give every request a timeline (engine.tracing). `handoff`: prefill only,
        each prompt handed to it once prefilled. `seed`: of unseeded sampling (default: the
        engine config's). `prefix_cache`: False keeps this engine from reusing cached prefixes
        whatever the config says (a decode node, whose KV arrives by transfer)."""
        config = runner.config
        self.runner = runner
        self.tokenizer = tokenizer
        self.speculator = speculator
        self.tracing = tracing
        self.handoff = handoff
        # A decode node admits by free rows, at most max_num_seqs. A prefill node's rows are
        # also held by prompts whose KV is being sent: all of them.
        self.kv_cache = KVCacheManager(
            runner.kv_pool,
            runner.req_to_token_pool,
            max_requests=None if handoff is not None else config.max_num_seqs,
            prefix_cache=make_prefix_cache(config, speculator, prefix_cache),
            companion=speculator.prefix_companion() if speculator is not None else None,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_seqs,
            config.max_prefill_tokens,
            on_release=speculator.release if speculator is not None else None,
            chunk_size=config.chunked_prefill_size,
            prefill_only=handoff is not None,
            mixed=config.mixed_prefill and speculator is None,
            mixed_max_tokens=mixed_step_tokens(config),
        )
        self.stop_checker = None
        if handoff is None:
            self.stop_checker = StopChecker(
                tokenizer, runner.model_config.eos_token_ids, config.max_model_len
            )
        self.default_generator = torch.Generator().manual_seed(
            config.seed if seed is None else seed
        )
        self.eos_token_ids = tuple(runner.model_config.eos_token_ids)
        self.speculative: SpeculativeSteps | None = None
        if speculator is not None:
            self.speculative = SpeculativeSteps(
                speculator, runner, self.scheduler, self.stop_checker, self._fail
            )
        # Plain decode steps overlap the host's work with the device's (engine.executor.overlap), a
        # speculating engine's plain steps too.
        self.overlap: OverlapDecoder | None = None
        if config.overlap_schedule and self.stop_checker is not None:
            self.overlap = OverlapDecoder(
                runner,
                self.scheduler,
                self.kv_cache,
                self.stop_checker,
                lambda logits, requests, in_flight: sample_overlapped(
                    logits, requests, in_flight, self.default_generator
                ),
                plans=self.speculative,
            )
        self.grammars: GrammarCompiler | None = None
        # Tokens that prefill forwards ran (chunks and re-prefills included; a prompt that
        # parallel samples share counts once).
        self.prefill_tokens = 0
        # Scheduled steps by kind; the decode steps overlap launched ahead are its own count
        # (`step_counts` adds them).
        self._steps = StepCounts()
        # Requests whose grammar is still compiling: they join the scheduler once it is done,
        # so that compiling a new schema never holds up the running batch.
        self.compiling: list[Request] = []

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        speculative: bool = True,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> Request:
        """Validate a request against this engine's limits; raises RequestRejectedError.
        `speculative=False` opts this request out of an engine's speculative decoding;
        `prompt_embeds` gives vectors for some prompt positions in place of their tokens'."""
        self._validate(prompt_token_ids, params, prompt_embeds)
        req = Request(request_id, list(prompt_token_ids), params, prompt_embeds=prompt_embeds)
        if params.grammar is not None:
            self.start_grammar(req)
        if self.tracing:
            req.trace = RequestTrace()
        if self.speculator is not None and speculative:
            req.num_draft_tokens = self.speculator.num_draft_steps
            req.spec_stats = SpecStats(accepted_per_position=[0] * req.num_draft_tokens)
        return req

    def plan_counts(self) -> dict[str, int]:
        """Decode steps by the label of their round plan (spec.runtime.round_plan) since the engine
        started: "plain", "chain/device", ...; empty for an engine that does not speculate."""
        return dict(self.speculative.plans) if self.speculative is not None else {}

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            vocab = self.runner.model_config.vocab_size
            # Built for the first request with a grammar: without the grammar library, that
            # request is rejected, naming the field, and every other request is served.
            self.grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
        return self.grammars

    def add_request(self, req: Request) -> None:
        if req.grammar is not None:
            # Even a cached grammar passes through: the next step checks that it compiled.
            self.compiling.append(req)
        else:
            self.scheduler.add(req)
        if self.handoff is not None:
            return  # a prefill node stamps its own queue's event ("prefill_queued")
        set_time(req, "queued")

    def start_grammar(self, req: Request) -> None:
        """Begin compiling the grammar of `req`'s params (cached per grammar text); raises
        RequestRejectedError where the grammar library is missing."""
        req.grammar = self._grammar_compiler().start(req.params.grammar)

    def add_samples(self, samples: list[Request]) -> None:
        """Parallel samples of one prompt (the same prompt tokens and vectors, their own
        sampling): the first prefills the prompt, the others take its prompt KV and sample
        their first token from its logits (Request.forks). Samples under a grammar each
        prefill their own: each joins when its own grammar has compiled. A group runs at once
        or not at all, so more samples than max_num_seqs share a prefill per max_num_seqs."""
        first = samples[0]
        assert all(
            f.prompt_token_ids == first.prompt_token_ids and f.prompt_embeds is first.prompt_embeds
            for f in samples
        ), "samples of one prompt"
        if any(req.grammar is not None for req in samples):
            for req in samples:
                self.add_request(req)
            return
        size = self.scheduler.max_num_seqs
        for start in range(0, len(samples), size):
            head, *forks = samples[start : start + size]
            head.forks = list(forks)
            for req in forks:
                set_time(req, "queued")
            self.add_request(head)

    def has_work(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        held = self.speculative is not None and bool(self.speculative.held)
        return in_flight or held or bool(self.compiling) or self.scheduler.has_work()

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; None if this engine does not hold it."""
        for req in self.compiling:
            if req.request_id == request_id:
                self.compiling.remove(req)
                req.finish_reason = "abort"
                return req
        if self.overlap is not None:
            self.overlap.settle(request_id)  # a step in flight may write its slots
        return self.scheduler.abort(request_id)

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it (with overlap scheduling,
        those that the step before it finished: engine.executor.overlap)."""
        failed = self._admit_compiled()
        if self.speculative is not None:
            # Slots held for a queued verify: waited for when admission may want them or no
            # decode step follows, else freed once it has run.
            scheduler = self.scheduler
            self.speculative.release_held(wait=bool(scheduler.waiting) or not scheduler.running)
        if self.overlap is not None and self.overlap.in_flight is not None:
            try:
                finished = self.overlap.step()
            except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
                finished = self.overlap.flush()
                return failed + finished + self._fail(list(self.scheduler.running), "decode", err)
            if finished is not None:
                return failed + finished
            self._steps.drains += 1
            failed += self.overlap.flush()
        batch = self.scheduler.schedule()
        if batch is None:
            if self.compiling and not failed:
                self.compiling[0].grammar.wait(GRAMMAR_WAIT_S)  # type: ignore[union-attr]
            return failed
        self._steps.count(batch)
        return failed + self._run(batch)

    def step_counts(self) -> StepCounts:
        """The forward steps run so far, by kind (engine.step_counts), those that overlap
        scheduling launched ahead among the decode steps."""
        overlapped = 0 if self.overlap is None else self.overlap.num_overlapped_steps
        return dataclasses.replace(self._steps, decode=self._steps.decode + overlapped)

    def _admit_compiled(self) -> list[Request]:
        """Hand the requests whose grammar compiled to the scheduler; end those whose grammar
        failed to compile, returning them."""
        failed = []
        for req in [r for r in self.compiling if r.grammar.ready]:  # type: ignore[union-attr]
            self.compiling.remove(req)
            error = req.grammar.error  # type: ignore[union-attr]
            if error is None:
                self.scheduler.add(req)
            elif self.handoff is not None:
                self.handoff.failed([req], error)
                failed.append(req)
            else:
                failed += self.scheduler.fail(req, error)
        return failed

    def _run(self, batch: ScheduledBatch) -> list[Request]:
        if batch.is_prefill:
            return self._prefill(batch)
        if any(req.num_draft_tokens for req in batch.requests):
            assert self.speculative is not None
            return self.speculative.decode(batch, self.default_generator, self.overlap)
        if self.overlap is not None and all(overlappable(req) for req in batch.requests):
            try:
                self.overlap.launch(batch.requests, self.runner.build_batch(batch.requests))
            except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
                return self._fail(batch.requests, "decode", err)
            return []  # its tokens are read after the next step is launched
        set_time_batch(batch.requests, "decode_start")
        try:
            _, tokens, logprobs = decode_plainly(
                self.runner, batch.requests, self.eos_token_ids, self.default_generator
            )
        except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
            return self._fail(batch.requests, "decode", err)
        finished = self.scheduler.process_result(batch, tokens, logprobs, self.stop_checker)
        set_time_batch(batch.requests, "decode_end")
        return finished

    def _prefill(self, batch: ScheduledBatch) -> list[Request]:
        """A prefill step: each request's prompt or its next chunk. The requests whose prompt
        completes sample their first token, and those that speculate draft over the prompt.
        A mixed step's running requests (`batch.decoding`) come first in the same forward,
        one token each, and sample their next token as a decode step's do."""
        completes = batch.completes()
        completing = batch.completing
        forks = [fork for fork, _ in batch.forks]
        decoding = batch.decoding
        # A preempted request begins again; a cached prefix does not count as begun.
        set_time_batch(batch.starting, "prefill_start")
        set_time_batch(decoding, "decode_start")
        keep_hidden = any(r.num_draft_tokens for r in batch.requests)
        assert not (keep_hidden and decoding), "a speculating engine runs no mixed step"
        requests = decoding + batch.requests
        try:
            if self.handoff is not None:
                self.handoff.prefill_completing(completing + forks)
            ends = [req.num_tokens for req in decoding] + batch.ends
            forward_batch = self.runner.build_batch(requests, ends)
            output = self.runner.forward(forward_batch, keep_hidden=keep_hidden)
            self.prefill_tokens += sum(forward_batch.extend_lens) - len(decoding)
            if self.handoff is not None:
                self.handoff.forward_enqueued(completing + forks)
            # Each fork samples its first token from its source's last logits.
            first = len(decoding)
            rows = list(range(first)) + [first + i for i, done in enumerate(completes) if done]
            if batch.forks:
                index = {id(req): i for i, req in enumerate(requests)}
                rows += [index[id(source)] for _, source in batch.forks]
            last = output.logits if rows == list(range(len(requests))) else output.logits[rows]
            tokens, logprobs = sample_next_tokens(
                last, decoding + completing + forks, self.eos_token_ids, self.default_generator
            )
        except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
            failed = self._fail(batch.requests + forks, "prefill", err)
            return failed + (self._fail(decoding, "decode", err) if decoding else [])
        drafting = []
        if keep_hidden:
            assert self.speculative is not None
            drafting = self.speculative.prompts_for_draft(batch, forward_batch.extend_lens, output)
        finished = self.scheduler.process_prefill(
            batch, tokens.tolist(), logprobs, self.stop_checker, forks
        )
        set_prefill_end(completing + forks)
        set_time_batch(decoding, "decode_end")
        failed = self.speculative.draft_extend_prefill(drafting) if drafting else []
        if self.handoff is not None:
            gone = {id(req) for req in failed}
            done = completing + forks
            sent = [i for i, req in enumerate(done) if id(req) not in gone]
            self.handoff.prefilled(
                [done[i] for i in sent],
                [logprobs[first + i] for i in sent],
                output.last_hidden[[rows[first + i] for i in sent]],
            )
        return finished + failed

    def _fail(self, requests: list[Request], stage: str, err: Exception) -> list[Request]:
        error = f"{stage} forward failed: {type(err).__name__}: {err}"
        if self.handoff is not None:
            # The handoff's owner frees them: their KV may still be read by a begun transfer.
            # Parallel samples still waiting for a failed prompt (between its chunks) end too.
            waiting = []
            for req in requests:
                self.scheduler.detach(req)
                req.held_chunks = None
                waiting += req.forks
                req.forks = []
            self.handoff.failed(requests + waiting, error)
            return requests + waiting
        ended = []
        for req in requests:
            ended += self.scheduler.fail(req, error)
        return ended

    def output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self.stop_checker.final_text(req),
            finish_reason=req.finish_reason or "abort",
            usage=Usage.of(req),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            trace=list(req.trace.events) if req.trace is not None else None,
        )

    def _validate(
        self, prompt: list[int], params: SamplingParams, prompt_embeds: PromptEmbeds | None
    ) -> None:
        config = self.runner.config
        validate_request(
            prompt,
            params,
            vocab_size=self.runner.model_config.vocab_size,
            max_model_len=config.max_model_len,
            max_tokens_cap=config.max_tokens_cap,
            kv_cache_tokens=config.kv_cache_tokens,
            hidden_size=self.runner.model_config.hidden_size,
            prompt_embeds=prompt_embeds,
        )

