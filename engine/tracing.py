"""Per-request timelines: named events stamped with the wall clock, cheap enough to stay in the
hot path.

A request's `trace` is a RequestTrace when its process traces (`--enable-tracing`), None
otherwise. A process traces all of its requests or none, so `set_time_batch` looks at the first
request of a batch only: with tracing off it returns before reading the clock or looping.
Events are `(name, time_ns)` or `(name, time_ns, args)` tuples (msgpack sends them as arrays;
tuples of plain values leave the garbage collector alone), stamped with `time.time_ns()` in
every process; the router aligns each node's clock to its own (cluster.control.tracing) and turns
the events into Chrome trace events.

Names ending in `_start` / `_end` bound a span (`verify_start` ... `verify_end` is the span
`verify`); the others are instants. See docs/architecture.md ("Tracing") for every name."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.request import Request

# The one clock every process stamps with, so that only a per-process offset separates them.
clock_ns = time.time_ns


class RequestTrace:
    """One request's events in this process, in the order they were stamped."""

    __slots__ = ("events", "_counted")

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        # The request's speculation counters (verify steps, proposed, accepted) as of the last
        # `set_correct_drafts`, so each step's figures are the difference.
        self._counted = (0, 0, 0)

    def add(self, name: str, time_ns: int, args: dict[str, Any] | None = None) -> None:
        self.events.append((name, time_ns) if args is None else (name, time_ns, args))

    def names(self) -> list[str]:
        return [event[0] for event in self.events]


def set_time_batch(
    requests: Sequence[Request],
    *names: str,
    where: Callable[[Request], bool] | None = None,
    args: dict[str, Any] | None = None,
) -> None:
    """Stamp each of `names`, in order, on the requests of a batch with one clock read; `where`
    picks the requests of the batch the events concern (evaluated only when tracing); `args`,
    if given, go with each event (a decode step's first events carry its round plan)."""
    if not requests or requests[0].trace is None:
        return
    now = clock_ns()
    for req in requests:
        if req.trace is None or (where is not None and not where(req)):
            continue
        for name in names:
            req.trace.events.append((name, now) if args is None else (name, now, args))


def set_time(req: Request, name: str, args: dict[str, Any] | None = None) -> None:
    """Stamp one event on one request (events that happen request by request)."""
    if req.trace is not None:
        req.trace.add(name, clock_ns(), args)


def set_prefill_end(requests: Sequence[Request]) -> None:
    """Stamp `prefill_end` on requests whose prompt is done, with the prompt tokens each read
    from the prefix cache (`cached_tokens`) rather than computed."""
    if not requests or requests[0].trace is None:
        return
    now = clock_ns()
    for req in requests:
        if req.trace is not None:
            req.trace.add("prefill_end", now, {"cached_tokens": req.cached_tokens})


def set_correct_drafts(requests: Sequence[Request]) -> None:
    """After a decode step counted its statistics: stamp `correct_drafts` with this step's draft
    tokens checked (`drafts`) and accepted (`correct`) on each request that verified drafts in
    it. Taken from the request's SpecStats, so the steps add up to the `usage` totals."""
    if not requests or requests[0].trace is None:
        return
    now = clock_ns()
    for req in requests:
        trace, stats = req.trace, req.spec_stats
        if trace is None or stats is None or stats.verify_steps == trace._counted[0]:
            continue
        _, proposed, accepted = trace._counted
        args = {
            "drafts": stats.proposed_tokens - proposed,
            "correct": stats.accepted_tokens - accepted,
        }
        trace.add("correct_drafts", now, args)
        trace._counted = (stats.verify_steps, stats.proposed_tokens, stats.accepted_tokens)
