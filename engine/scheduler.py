"""Continuous batching with a two-call contract: `schedule()` picks the next batch and reserves
its KV slots; `process_result()` takes the sampled tokens and retires finished requests.

Prefill goes first whenever waiting requests fit in free KV; otherwise every running request
decodes one token. When the pool runs dry mid-decode the newest running request is preempted:
its slots are freed and it waits to be prefilled again over prompt + output so far.

Speculating requests (`req.num_draft_tokens > 0`) decode several tokens per step: each step
reserves slots for the draft tokens it verifies (`req.lookahead`) beyond the newest token, and
`process_tokens` commits a list of tokens per request. `on_release` lets the speculator free a
request's draft KV whenever its target KV is freed (finish, preemption, abort, failure)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampler import TokenLogprob
from engine.stopping import StopChecker


@dataclass
class ScheduledBatch:
    requests: list[Request]
    is_prefill: bool


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_prefill_tokens: int,
        on_release: Callable[[Request], None] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.on_release = on_release
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        prefill = self._admit_waiting()
        if prefill:
            return ScheduledBatch(prefill, is_prefill=True)
        if not self.running:
            return None
        while not self.kv_cache.can_grow(self._slots_for_next_token()):
            victim = self.running.pop()
            assert self.running, "a lone request outgrew the pool; admission should refuse it"
            self._preempt(victim)
        grants = [(req, _missing_slots(req)) for req in self.running]
        self.kv_cache.grow_many([(req, n) for req, n in grants if n])
        return ScheduledBatch(list(self.running), is_prefill=False)

    def _slots_for_next_token(self) -> int:
        return sum(_missing_slots(req) for req in self.running)

    def add_running(self, req: Request) -> None:
        """Join a request whose prompt KV is already cached (computed elsewhere) to decoding."""
        assert req.kv_len == req.num_tokens - 1 and len(req.slots) >= req.num_tokens - 1
        self.running.append(req)

    def _admit_waiting(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        # One decode step's slots per running or admitted request stay free, so admitting this
        # prompt cannot force a preemption on the very next decode step.
        reserve = sum(1 + r.lookahead for r in self.running)
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            req = self.waiting[0]
            need = req.num_tokens - req.kv_len
            if batch and tokens + need > self.max_prefill_tokens:
                break
            if not self.kv_cache.can_grow(need + reserve + 1 + req.lookahead, 1):
                break
            self.kv_cache.grow(req, need)
            batch.append(self.waiting.popleft())
            tokens += need
            reserve += 1 + req.lookahead
        return batch

    def _release(self, req: Request) -> None:
        self.kv_cache.release(req)
        if self.on_release is not None:
            self.on_release(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def process_result(
        self,
        batch: ScheduledBatch,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        stop_checker: StopChecker,
    ) -> list[Request]:
        return self.process_tokens(
            batch, [[t] for t in tokens], [[lp] for lp in logprobs], stop_checker
        )

    def process_tokens(
        self,
        batch: ScheduledBatch,
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprob | None]],
        stop_checker: StopChecker,
    ) -> list[Request]:
        """Commit each request's new tokens in order, stopping at the first that finishes it
        (a verify step may commit several; those after a stop are dropped)."""
        finished = []
        for req, new_tokens, new_logprobs in zip(batch.requests, tokens, logprobs):
            for token, logprob in zip(new_tokens, new_logprobs):
                req.commit(token)
                if logprob is not None:
                    req.logprobs.append(logprob)
                req.finish_reason = stop_checker.check(req)
                if req.finished:
                    break
            # Every committed token but the newest has its KV cached now.
            req.kv_len = req.num_tokens - 1
            if req.finished:
                finished.append(req)
            elif batch.is_prefill:
                self.running.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._release(req)
        return finished

    def fail(self, req: Request, error: str) -> None:
        """End a request that hit an error: it leaves every queue and gives back its slots."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.error = error
        req.finish_reason = "error"

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    self._release(req)
                    req.finish_reason = "abort"
                    return req
        return None


def _missing_slots(req: Request) -> int:
    """Slots the request lacks for its next decode step: its newest token and the look-ahead.
    Requests with preallocated slots (decode nodes reserve prompt + max_tokens) lack none."""
    return max(0, req.num_tokens + req.lookahead - len(req.slots))
