"""Per-request traces across the cluster: the router's own timeline of a request, merged with
the prefill and decode nodes' (engine.tracing events, reported with the finished request) into
Chrome trace-event JSON, which opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

One process per node: `router`, `prefill-i`, `decode-j`, each a track. Spans (`X` events) come
from `<name>_start` / `<name>_end` pairs, the other events are instants (`i`); every span and
instant carries `args.request_id`, and a flow (router -> prefill -> decode) links the request's
slices.

Clocks: every process stamps `time.time_ns()`. At connect time the launcher measures each
node's offset to the router's clock (`clock_offset_ns`); when merging, the offset is narrowed
to what causality allows (a node cannot receive a message before it was sent), so an error of
the measurement (up to half a Ray round trip) never shows a message arriving before it left."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.tracing import clock_ns

log = logging.getLogger(__name__)
TRACES_KEPT = 256  # the most recent traces GET /v1/traces/{id} can answer
ROUTER_PID = 1
_ROLE_PID_BASE = {"prefill": 100, "decode": 200, "replica": 300}
_DECODE_STEP_SPANS = ("draft", "decode")  # each decode step opens one of these first


def clock_offset_ns(read_remote_clock: Callable[[], int], samples: int = 8) -> int:
    """What to add to a remote process's `time_ns` to get this process's: the midpoint of a
    request and its answer minus the remote reading, from the sample with the shortest round
    trip (the least room for an asymmetric delay)."""
    best_round_trip, best = math.inf, 0
    for _ in range(samples):
        sent = clock_ns()
        remote = read_remote_clock()
        received = clock_ns()
        if received - sent < best_round_trip:
            best_round_trip, best = received - sent, (sent + received) // 2 - remote
    return best


@dataclass
class NodeTimeline:
    """One node's events of a request, in that node's clock, and its measured offset."""

    name: str  # "prefill-0", "decode-1"
    events: list[list[Any]]
    clock_offset_ns: int = 0

    @property
    def role(self) -> str:
        return self.name.rpartition("-")[0]

    @property
    def pid(self) -> int:
        role, _, index = self.name.rpartition("-")
        return _ROLE_PID_BASE[role] + int(index)


class RequestTimeline:
    """The router's events of one request (its clock is the trace's)."""

    def __init__(self, request_id: str, given: list[tuple[str, int]] | None = None) -> None:
        self.request_id = request_id
        self.room: int | None = None
        # The HTTP layer gives arrival and tokenized; a caller of the router alone gives none.
        self.events: list[list[Any]] = [[name, t] for name, t in given or [("arrival", clock_ns())]]

    def mark(self, name: str, args: dict[str, Any] | None = None) -> None:
        self.events.append([name, clock_ns()] if args is None else [name, clock_ns(), args])


class TraceStore:
    """The last TRACES_KEPT traces by request id, each also written to `trace_dir` if given,
    where `get` finds the traces that another API process of the cluster closed (or that
    left the memory). `prune_files`: a trace that leaves the memory leaves the folder too (a
    folder the cluster made to share them, not the user's)."""

    def __init__(
        self, trace_dir: str | None = None, keep: int = TRACES_KEPT, prune_files: bool = False
    ) -> None:
        self.trace_dir = Path(trace_dir) if trace_dir else None
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.prune_files = prune_files and self.trace_dir is not None
        self._traces: OrderedDict[str, dict] = OrderedDict()

    def begin(self, request_id: str, given: list[tuple[str, int]] | None = None) -> RequestTimeline:
        return RequestTimeline(request_id, given)

    def get(self, request_id: str) -> dict | None:
        trace = self._traces.get(request_id)
        path = self.path_of(request_id) if trace is None else None
        if path is not None:
            try:
                trace = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
        return trace

    def path_of(self, request_id: str) -> Path | None:
        if self.trace_dir is None:
            return None
        return self.trace_dir / f"{re.sub(r'[^A-Za-z0-9._-]', '_', request_id)}.json"

    async def finish(
        self,
        timeline: RequestTimeline,
        finish_reason: str,
        nodes: list[NodeTimeline],
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        """Close the request's trace: merge, keep, write; returns its summary for `usage`."""
        timeline.mark("finish", {"reason": finish_reason})
        trace = chrome_trace(timeline, nodes, usage)
        request_id = timeline.request_id
        self._traces[request_id] = trace
        self._traces.move_to_end(request_id)
        while len(self._traces) > self.keep:
            evicted, _ = self._traces.popitem(last=False)
            if self.prune_files:
                self.path_of(evicted).unlink(missing_ok=True)
        path = self.path_of(request_id)
        if path is not None:
            text = json.dumps(trace, separators=(",", ":"))
            try:
                await asyncio.to_thread(path.write_text, text)
            except OSError as err:  # a full or read-only disk loses the file, not the request
                log.warning("could not write the trace of %s: %s", request_id, err)
        return trace["otherData"]["trace_summary"]


def chrome_trace(
    router: RequestTimeline, nodes: list[NodeTimeline], usage: dict[str, Any]
) -> dict[str, Any]:
    """The request's Chrome trace-event JSON (`nodes`: its prefill node's and decode node's
    timelines), with its summary under otherData.trace_summary."""
    by_role = {node.role: node for node in nodes}
    # An aggregated cluster's replica talks to the router as a decode node does.
    prefill, decode = by_role.get("prefill"), by_role.get("decode") or by_role.get("replica")
    aligned = _align(router.events, prefill, decode)
    request_id = router.request_id
    tracks = [("router", ROUTER_PID, router.events)]
    tracks += [
        (node.name, node.pid, aligned[key])
        for key, node in (("prefill", prefill), ("decode", decode))
        if node is not None
    ]
    events: list[dict[str, Any]] = []
    for sort_index, (name, pid, track) in enumerate(tracks):
        events += _metadata(name, pid, sort_index)
        events += _track_events(pid, track)
    pids = (prefill.pid if prefill else 0, decode.pid if decode else 0)
    events += _cross_track_spans(router.events, aligned["prefill"], aligned["decode"], *pids)
    events += _flow(router, aligned["prefill"], aligned["decode"], *pids)
    summary = summarize(router.events, aligned["prefill"], aligned["decode"], usage)
    for event in events:
        if event["ph"] in "Xi":
            event["args"]["request_id"] = request_id
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"request_id": request_id, "room": router.room, "trace_summary": summary},
    }


def summarize(
    router: list[list[Any]],
    prefill: list[list[Any]],
    decode: list[list[Any]],
    usage: dict[str, Any],
) -> dict[str, Any]:
    """TTFT and end to end (router clock), the KV transfer from the prefill node's start to the
    decode node's landing (aligned clocks) and its bytes, and the accept length."""
    arrival, first, finish = (_time(router, n) for n in ("arrival", "first_token", "finish"))
    sent, landed = _time(prefill, "transfer_start"), _event(decode, "transfer_end")
    return {
        "ttft_ms": _ms(first, arrival),
        "e2e_ms": _ms(finish, arrival),
        "transfer_ms": _ms(landed[1] if landed else None, sent),
        "transfer_bytes": landed[2]["bytes"] if landed and len(landed) > 2 else None,
        "accept_length": usage.get("spec_accept_length"),
        "verify_steps": usage.get("spec_verify_steps"),
    }


# --- clocks ---
def _align(
    router: list[list[Any]], prefill: NodeTimeline | None, decode: NodeTimeline | None
) -> dict[str, list[list[Any]]]:
    """The prefill and decode node's events in the router's clock. The decode node talks to
    the router (the request in, tokens out), the prefill node to the decode node (the request
    in, the transfer out): each measured offset is kept within what those messages allow."""
    aligned: dict[str, list[list[Any]]] = {"prefill": [], "decode": []}
    if decode is not None:
        events = decode.events
        offset = _narrow(
            decode.clock_offset_ns,
            lows=[_diff(_time(router, "routed"), _time(events, "decode_received"))],
            highs=[
                _diff(_time(router, "first_token"), _time(events, "first_token")),
                _diff(_time(router, "finish"), _time(events, "finish")),
            ],
        )
        aligned["decode"] = _shift(events, offset)
    if prefill is not None:
        events, by_decode = prefill.events, aligned["decode"]
        offset = _narrow(
            prefill.clock_offset_ns,
            lows=[_diff(_time(by_decode, "prefill_requested"), _time(events, "prefill_queued"))],
            highs=[_diff(_time(by_decode, "transfer_end"), _time(events, "transfer_start"))],
        )
        aligned["prefill"] = _shift(events, offset)
    return aligned


def _narrow(estimate: int, lows: list[int | None], highs: list[int | None]) -> int:
    low = max((x for x in lows if x is not None), default=-math.inf)
    high = min((x for x in highs if x is not None), default=math.inf)
    if low > high:  # the timelines contradict each other: keep the measurement
        return estimate
    return int(min(max(estimate, low), high))


def _shift(events: list[list[Any]], offset: int) -> list[list[Any]]:
    return [[name, t + offset, *rest] for name, t, *rest in events]


# --- Chrome trace events ---
def _metadata(name: str, pid: int, sort_index: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "pid": pid, "tid": 1, "name": "process_name", "args": {"name": name}},
        {
            "ph": "M",
            "pid": pid,
            "tid": 1,
            "name": "process_sort_index",
            "args": {"sort_index": sort_index},
        },
        {"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "requests"}},
    ]


def _track_events(pid: int, events: list[list[Any]]) -> list[dict[str, Any]]:
    """Spans from _start/_end pairs, instants for the rest. On a decode track each step's
    spans carry the step number, the verify span this step's draft counts (`drafts`,
    `correct_drafts`), and the draft span where its chain came from: the draft extend for
    prefill on the first step, the previous step's draft extend after that."""
    out: list[dict[str, Any]] = []
    opened: dict[str, tuple[int, dict[str, Any], int]] = {}
    step, drafted, last_verify = 0, False, None
    for name, t, *rest in events:
        args = dict(rest[0]) if rest else {}
        base = name.removesuffix("_start")
        if base != name:
            step += base in _DECODE_STEP_SPANS
            opened[base] = (t, args, step)
            continue
        base = name.removesuffix("_end")
        if base != name and base in opened:
            start, start_args, span_step = opened.pop(base)
            span_args = {**start_args, **args}
            if span_step:
                span_args["step"] = span_step
            if base == "draft":
                span_args["chain_from"] = "draft_extend" if drafted else "prefill"
                drafted = True
            out.append(_span(base, pid, start, t, span_args))
            if base == "verify":
                last_verify = out[-1]
            continue
        if name == "correct_drafts" and last_verify is not None:
            last_verify["args"].update(drafts=args["drafts"], correct_drafts=args["correct"])
            out.append(_counter(name, pid, t, {"correct": args["correct"]}))
            continue
        out.append(_instant(name, pid, t, args))
    for base, (start, args, _) in opened.items():  # a span its failure never closed
        out.append(_instant(f"{base}_start", pid, start, args))
    return out


def _cross_track_spans(
    router: list[list[Any]],
    prefill: list[list[Any]],
    decode: list[list[Any]],
    prefill_pid: int,
    decode_pid: int,
) -> list[dict[str, Any]]:
    """The request on the router's track, the transfer (prefill's send to decode's landing) on
    the prefill node's, the posted receive on the decode node's."""
    out = []
    arrival, finish = _time(router, "arrival"), _time(router, "finish")
    if arrival is not None and finish is not None:
        out.append(_span("request", ROUTER_PID, arrival, finish, {}))
    start, landed = _event(prefill, "transfer_start"), _event(decode, "transfer_end")
    sent = start[1] if start is not None else None
    if sent is not None and landed is not None:
        args = dict(start[2]) if len(start) > 2 else {}
        args.update(landed[2] if len(landed) > 2 else {})
        out.append(_span("transfer", prefill_pid, sent, max(sent, landed[1]), args))
    posted = _time(decode, "receive_posted")
    if posted is not None and landed is not None:
        out.append(_span("receive", decode_pid, posted, max(posted, landed[1]), {}))
    return out


def _flow(
    router: RequestTimeline,
    prefill: list[list[Any]],
    decode: list[list[Any]],
    prefill_pid: int,
    decode_pid: int,
) -> list[dict[str, Any]]:
    """Arrows from the router's request slice to the prefill slice to the receive slice."""
    points = [
        (ROUTER_PID, _time(router.events, "arrival")),
        (prefill_pid, _time(prefill, "prefill_start")),
        (decode_pid, _time(decode, "receive_posted")),
    ]
    points = [(pid, t) for pid, t in points if t is not None]
    flow_id = (router.room or 0) % 2**53
    out = []
    for i, (pid, t) in enumerate(points):
        phase = "s" if i == 0 else ("f" if i == len(points) - 1 else "t")
        event = {"ph": phase, "name": "request", "cat": "request", "id": flow_id}
        event.update(pid=pid, tid=1, ts=t / 1e3)
        if phase == "f":
            event["bp"] = "e"
        out.append(event)
    return out if len(out) > 1 else []


def _span(name: str, pid: int, start: int, end: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": "request",
        "pid": pid,
        "tid": 1,
        "ts": start / 1e3,
        "dur": (end - start) / 1e3,
        "args": args,
    }


def _instant(name: str, pid: int, t: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "ph": "i",
        "s": "t",
        "name": name,
        "cat": "request",
        "pid": pid,
        "tid": 1,
        "ts": t / 1e3,
        "args": args,
    }


def _counter(name: str, pid: int, t: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "C", "name": name, "pid": pid, "tid": 1, "ts": t / 1e3, "args": args}


# --- looking events up ---
def _event(events: list[list[Any]], name: str) -> list[Any] | None:
    return next((event for event in events if event[0] == name), None)


def _time(events: list[list[Any]], name: str) -> int | None:
    event = _event(events, name)
    return event[1] if event is not None else None


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _ms(end: int | None, start: int | None) -> float | None:
    gap = _diff(end, start)
    return None if gap is None else round(gap / 1e6, 3)
