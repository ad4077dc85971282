"""Continuous batching with a two-call contract: `schedule()` picks the next batch and reserves
its KV slots; `process_result()` takes the sampled tokens and retires finished requests.

Prefill goes first whenever waiting requests fit in free KV; otherwise every running request
decodes one token. KV grows with each step: a request holds slots for what it has computed plus
its next step, never for its whole max_tokens up front. When the pool runs short mid-decode,
running requests are retracted (`retraction_victim` picks which) until the step fits: a retracted
request's slots are freed and it waits, first in line, to be prefilled again over prompt +
output so far, which gives the same tokens as if it had never left (greedy, or seeded by
position). A decode node's requests join through `add_running` and retract the same way.

Speculating requests (`req.num_draft_tokens > 0`) decode several tokens per step: each step
reserves slots for the draft tokens it verifies (`req.lookahead`) beyond the newest token, and
`process_tokens` commits a list of tokens per request. `on_release` lets the speculator free a
request's draft KV whenever its target KV is freed (finish, retraction, abort, failure). Draft
KV grows inside the speculator's draft extends, never past the slots the same request holds in
the target, in pools as large as the target's with room for what parallel samples share less
there (spec.runtime.draft_runner): a step that fits the target fits every depth, so only the
target's pool is checked here.

With `chunk_size`, a prompt longer than that is prefilled over several steps, one chunk each
(at most one prompt in chunks at a time; it keeps the head of the queue, and holds its chunks'
KV, between them). Whole prompts behind it join its steps while the step's token budget
allows, so a short request is not kept waiting for a long one. While a prompt is in chunks,
running requests keep generating: its chunks ride in their decode steps (mixed, below), or
where a chunk runs in a step of its own, prefill steps and decode steps alternate.

With `mixed`, a step that admits prompts while requests run is one forward of both (a mixed
step): every running request's next token (a span of one over its cached KV) and the admitted
prompts or a prompt's chunk, so that admitting never stops the running requests. Its decode
tokens count in the step's token budget (`max_prefill_tokens`), and it takes the running
requests' slots for this step and keeps `step_reserve` free for the next, as a prefill step
followed by a decode step would. A mixed step that cannot admit anything (a chunk left no
room by the decode tokens, or the KV short of both steps' slots) leaves the step what it was
without mixing, and so does one of more than `mixed_max_tokens` tokens (an engine whose decode
steps replay CUDA graphs mixes only where a prefill graph holds the step: see EngineCore).
Speculating engines do not mix: their decode step is a verify of its own.

With a prefix cache (engine.scheduling.kv_cache), a request admitted with no KV starts at the
longest cached prefix of its tokens (a re-prefill after retraction too): only the rest is computed,
and the cached slots count as free room wherever no request holds them. What a prefill step
computes joins the cache at once; what a request decoded joins it when it lets go of its slots
(finished, retracted or aborted; never after a failure).

`prefill_only` (a prefill node): prompts are prefilled and sample their first token, then
leave the scheduler without being released; their owner frees them (`KVCacheManager.release`)
once their KV has been sent."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from engine.request import Request
from engine.sampling.sampler import TokenLogprob
from engine.sampling.stopping import StopChecker
from engine.scheduling.kv_cache import KVCacheManager
from engine.scheduling.scheduled_batch import ScheduledBatch


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_prefill_tokens: int,
        on_release: Callable[[Request], None] | None = None,
        chunk_size: int | None = None,
        prefill_only: bool = False,
        mixed: bool = False,
        mixed_max_tokens: int | None = None,
    ) -> None:
        """`mixed`: prompts are admitted into the running requests' decode step (see the
        module's doc); only for engines whose requests decode one token a step.
        `mixed_max_tokens`: the most tokens a mixed step may run (None: max_prefill_tokens
        alone bounds it; 0: no step is mixed)."""
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.kv_cache = kv_cache
        self.on_release = on_release
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.prefill_only = prefill_only
        self.mixed = mixed and not prefill_only
        self.mixed_max_tokens = mixed_max_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Set by a prefill step that left a prompt in chunks: the next step decodes, if any
        # request is running.
        self._decode_turn = False
        self.num_retractions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        if self.mixed and self.running and self.waiting:
            mixed = self._admit_waiting(self.running, self.mixed_max_tokens)
            if mixed is not None:
                self._decode_turn = False
                return mixed
        if not (self._decode_turn and self.running):
            prefill = self._admit_waiting()
            if prefill is not None:
                self._decode_turn = not all(prefill.completes())
                return prefill
        self._decode_turn = False
        # Alone, a request always fits where nothing else holds slots (admission checked prompt +
        # max_tokens against the pool); on a decode node, slots held for transfers still on
        # their way may leave even the last running request short: it waits like the others.
        grants = []  # the requests that lack slots, and how many
        for req in self.running:
            missing = _missing_slots(req)
            if missing:
                grants.append((req, missing))
        while grants and not self.kv_cache.can_grow(sum(n for _, n in grants)):
            victim = retraction_victim(self.running)
            self.running.remove(victim)
            self._retract(victim)
            grants = [(req, n) for req, n in grants if req is not victim]
        if not self.running:
            return None
        self.kv_cache.grow_many(grants)
        return ScheduledBatch(list(self.running), is_prefill=False)

    def may_admit(self) -> bool:
        """Whether the next step may admit the head of the waiting queue: a seat is free for
        it and its parallel samples. False: the next step can only decode the running set
        (or retract from it); a prompt waits for a request to finish."""
        if not self.waiting:
            return False
        head = self.waiting[0]
        return len(self.running) + 1 + len(head.forks) <= self.max_num_seqs

    def step_reserve(self) -> int:
        """Slots to keep free when admitting more work: one decode step (newest token and
        look-ahead) of every running request, so that admitting cannot force a retraction on
        the very next step."""
        return sum(1 + req.lookahead for req in self.running)

    def add_running(self, req: Request) -> None:
        """Join a request whose prompt KV is already cached (computed elsewhere) to decoding."""
        assert req.kv_len == req.num_tokens - 1 and len(req.slots) >= req.num_tokens - 1
        self.running.append(req)

    def _admit_waiting(
        self, decoding: list[Request] | None = None, max_tokens: int | None = None
    ) -> ScheduledBatch | None:
        """The waiting requests that the next prefill step runs, in queue order, stopping at
        the first that does not fit; None when none does. With `decoding` (the running
        requests: a mixed step), their next tokens share the step's token budget and their
        slots are taken with the prompts'. None too, taking nothing, where the step would
        run more than `max_tokens` tokens."""
        if not self.waiting:
            return None  # before step_reserve, a walk over the running requests
        decoding = decoding or []
        admitted: list[Request] = []
        ends: list[int] = []
        tokens = len(decoding)
        # One decode step's slots per running or admitted request stay free (`step_reserve`).
        reserve = 0 if self.prefill_only else self.step_reserve()
        partial: Request | None = None
        joining = 0  # forks that join the running set with the admitted requests
        forks: list[tuple[Request, Request]] = []
        # Slots and rows are taken once the batch is chosen, in one write to the row table:
        # a large prefill admits tens of requests, and each write is a copy to the device.
        # A mixed step's decoding requests take this step's slots first.
        grants = [(req, n) for req in decoding if (n := _missing_slots(req))]
        granted_slots = sum(n for _, n in grants)
        granted_rows = 0
        matched: list[Request] = []  # started at a cached prefix here: undone if not admitted
        starting: list[Request] = []
        for req in self.waiting:
            if len(self.running) + len(admitted) + joining + 1 + len(req.forks) > self.max_num_seqs:
                break
            if self.kv_cache.match_prefix(req):
                matched.append(req)
            need = req.num_tokens - req.kv_len
            take = need
            if self.chunk_size is not None:
                take = min(need, self.chunk_size, self.max_prefill_tokens - tokens)
                if take < need and partial is not None:
                    break  # one prompt in chunks at a time
            if take <= 0 or (admitted and tokens + take > self.max_prefill_tokens):
                break
            decodes_next = not self.prefill_only and take == need
            # Forks join once the prompt is done, each decoding its own step after it.
            after = (1 + req.lookahead) * (1 + len(req.forks)) if decodes_next else 0
            rows = (0 if req.row is not None else 1) + (len(req.forks) if take == need else 0)
            slots_after = granted_slots + take + reserve + after
            if not self.kv_cache.can_grow(slots_after, granted_rows + rows):
                break
            if req.row is None:
                starting.append(req)
            grants.append((req, take))
            granted_slots += take
            granted_rows += rows
            admitted.append(req)
            joining += len(req.forks)
            if take == need and req.forks:
                forks += [(fork, req) for fork in req.forks]
            ends.append(req.kv_len + take)
            tokens += take
            reserve += after
            if take < need:
                partial = req
        if not admitted or (max_tokens is not None and tokens > max_tokens):
            admitted = []
        chosen = {id(req) for req in admitted}
        for req in matched:
            if id(req) not in chosen:
                self.kv_cache.unmatch(req)
        if not admitted:
            return None
        self.kv_cache.grow_many(grants)
        forked = {id(source) for _, source in forks}  # prompts that complete: forks take them
        for req in admitted:
            if id(req) in forked:
                self.kv_cache.fork(req, req.forks, req.num_tokens)
                req.forks = []
        # The admitted requests are the queue's head; a prompt left in chunks stays at its front.
        for _ in admitted:
            self.waiting.popleft()
        if partial is not None:
            self.waiting.appendleft(partial)
        return ScheduledBatch(
            admitted,
            is_prefill=True,
            ends=ends,
            forks=forks,
            decoding=list(decoding),
            starting=starting,
        )

    def _release(self, req: Request, cache: bool = True) -> None:
        self.kv_cache.release(req, cache)
        req.held_chunks = None
        if self.on_release is not None:
            self.on_release(req)

    def _retract(self, req: Request) -> None:
        self._release(req)
        req.num_preemptions += 1
        self.num_retractions += 1
        # Behind a prompt in chunks, which holds KV and must finish first.
        in_chunks = bool(self.waiting) and self.waiting[0].kv_len > 0
        self.waiting.insert(1 if in_chunks else 0, req)

    def process_prefill(
        self,
        batch: ScheduledBatch,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        stop_checker: StopChecker | None,
        forks: Sequence[Request] = (),
    ) -> list[Request]:
        """After a prefill step: requests that prefilled a chunk advance their cached prefix;
        the others (`batch.completing`, then the `forks` that took their prompt KV, whose
        sampled tokens and logprobs these are, in order) commit their first token. A mixed
        step's `batch.decoding` come first in `tokens` and `logprobs`, and commit their next
        token as a decode step's requests do."""
        assert batch.ends is not None
        finished = []
        decoded = len(batch.decoding)
        if decoded:
            running = ScheduledBatch(batch.decoding, is_prefill=False)
            finished = self.process_result(
                running, tokens[:decoded], logprobs[:decoded], stop_checker
            )
        for req, end, done in zip(batch.requests, batch.ends, batch.completes()):
            if not done:
                req.kv_len = end
        completing = ScheduledBatch(batch.completing + list(forks), is_prefill=True)
        finished += self.process_result(
            completing, tokens[decoded:], logprobs[decoded:], stop_checker
        )
        # What this step computed is there for the next request with the same prefix (the
        # finished ones gave theirs to the cache when they let their slots go).
        for req in batch.requests:
            if not req.finished:
                self.kv_cache.cache_prefix(req)
        return finished

    def process_result(
        self,
        batch: ScheduledBatch,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        stop_checker: StopChecker,
        keep_slots: bool = False,
    ) -> list[Request]:
        return self.process_tokens(
            batch, [[t] for t in tokens], [[lp] for lp in logprobs], stop_checker, keep_slots
        )

    def process_tokens(
        self,
        batch: ScheduledBatch,
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprob | None]] | None,
        stop_checker: StopChecker | None,
        keep_slots: bool = False,
    ) -> list[Request]:
        """Commit each request's new tokens in order, stopping at the first that finishes it
        (`StopChecker.commit`). Prefill-only: the first token is committed unchecked (the
        decode node checks it) and the request leaves. `logprobs`: per request one entry per
        token (None where it has none), or None when no token has one. `keep_slots`: finished
        requests leave the queues with their slots still held (a step still running may write
        them); the caller `release`s them later."""
        finished = []
        if logprobs is None:
            logprobs = [()] * len(tokens)
        for req, new_tokens, new_logprobs in zip(batch.requests, tokens, logprobs):
            if self.prefill_only:
                for token in new_tokens:
                    req.commit(token)
                req.logprobs += [lp for lp in new_logprobs if lp is not None]
                req.kv_len = req.num_tokens - 1
                continue
            if new_tokens:
                req.finish_reason = stop_checker.commit(req, new_tokens, new_logprobs)
            # Every committed token but the newest has its KV cached now.
            req.kv_len = req.num_tokens - 1
            if req.finished:
                finished.append(req)
            elif batch.is_prefill:
                self.running.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            if not keep_slots:
                for req in finished:
                    self._release(req)
        return finished

    def release(self, req: Request) -> None:
        """Free the slots of a request that left the queues with them (`keep_slots`)."""
        self._release(req)

    def detach(self, req: Request) -> None:
        """Take a request out of the queues, its slots still held: its owner frees them."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def fail(self, req: Request, error: str) -> list[Request]:
        """End a request that hit an error: it leaves every queue and gives back its slots; the
        forks waiting for its prompt end with it. Returns the requests ended."""
        self.detach(req)
        self._release(req, cache=False)
        req.error = error
        req.finish_reason = "error"
        forks, req.forks = req.forks, []
        for fork in forks:
            fork.error = error
            fork.finish_reason = "error"
        return [req, *forks]

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    if req.forks and queue is self.waiting:
                        # Its forks still wait for a prompt: the first one prefills it.
                        heir, *rest = req.forks
                        heir.forks, req.forks = rest, []
                        self.waiting.insert(self.waiting.index(req), heir)
                    queue.remove(req)
                    self._release(req)
                    req.finish_reason = "abort"
                    return req
                for fork in req.forks:
                    if fork.request_id == request_id:
                        req.forks.remove(fork)
                        fork.finish_reason = "abort"
                        return fork
        return None


def retraction_victim(running: Sequence[Request]) -> Request:
    """The running request to retract when the pool runs short: the one that costs least to
    redo. That is the one with the fewest decoded tokens, the longest prompt among those, the
    newest among equals (SGLang's order). Its output is kept, so redoing it is one prefill over
    prompt + output; the fewest decoded tokens means the least progress set back and the
    smallest re-prefill, so a request that was retracted once (and keeps its output) is not
    the next victim on its return; among equals the longest prompt frees the most slots."""
    newest_first = reversed(running)
    return min(newest_first, key=lambda r: (len(r.output_token_ids), -len(r.prompt_token_ids)))


def _missing_slots(req: Request) -> int:
    """Slots the request lacks for its next decode step: its newest token and the look-ahead
    (a request that just joined from a transfer was given them with its prompt's)."""
    return max(0, req.num_tokens + req.lookahead - len(req.slots))
