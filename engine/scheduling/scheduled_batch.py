"""What one scheduler step runs (engine.scheduling.scheduler): the requests, and for a prefill step
how far each goes, the parallel samples that join it and the running requests mixed into it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledBatch:
    requests: list[Request]
    is_prefill: bool
    # Prefill only: the position each request's forward extends its KV to in this step. A
    # request whose end is its num_tokens completes its prompt (and samples); the others
    # prefill a chunk of it.
    ends: list[int] | None = None
    # Prefill only: (fork, the request whose prompt KV it took) for parallel samples that join
    # with a prompt completed in this step (Request.forks).
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    # A mixed step: the running requests that decode their next token in the same forward,
    # before the prompts (Scheduler's `mixed`).
    decoding: list[Request] = field(default_factory=list)
    # Prefill only: the requests that begin their prefill in this step (a new or retracted
    # one, which may start past a cached prefix; not a prompt's later chunk).
    starting: list[Request] = field(default_factory=list)

    def completes(self) -> list[bool]:
        if self.ends is None:
            return [True] * len(self.requests)
        return [end == req.num_tokens for req, end in zip(self.requests, self.ends)]

    @property
    def completing(self) -> list[Request]:
        return [req for req, done in zip(self.requests, self.completes()) if done]
