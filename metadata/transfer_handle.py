"""The state of one transfer (`TransferHandle`), shared between the node that asked for it and
the data plane's worker thread that finishes it (metadata/transfer.py)."""

from __future__ import annotations

import threading
import time
from enum import IntEnum

import torch
import torch.distributed as dist


class TransferState(IntEnum):
    """Poll state of one transfer: moves forward only; FAILED may replace any state but SUCCESS
    and is final."""

    FAILED = -1
    BOOTSTRAPPING = 0
    WAITING = 1
    TRANSFERRING = 2
    SUCCESS = 3


class TransferHandle:
    """The state of one transfer, shared between the caller and the worker thread that runs it.

    `phases`: host seconds from the start of the job to each phase it reached, in order. A
    sender's clock starts when the caller hands the transfer over: "begun" (only after
    `KVSender.begin`: the leading pools posted), "gathered" (the gathers of pools whose slots
    are scattered enqueued; nothing to do for the others), "posted" (the batch of sends
    returned), "completed" (the sends done, seen by the peer's worker). A receiver's starts
    when its worker takes the job: "posted" (the batch of receives returned), "landed" (the
    receives done), "scattered" (scatters and the row copy enqueued), "synced" (they ran).
    `gpu_phases`: the same phases on the streams they ran on, in seconds since the job's first
    event, only from workers made with `phase_events`. `staged`: how many pools went through a
    staging tensor on this side (the others moved straight from or into the pool)."""

    def __init__(self, room: int, peer: int, timeout_s: float = 120.0) -> None:
        self.room = room
        self.peer = peer
        self.timeout_s = timeout_s  # how long the transfer may take once posted
        self.error: str | None = None
        self.nbytes = 0
        self.staged = 0
        # Set when the job stopped waiting on operations it had posted (a timeout): neither
        # backend cancels them, so they may still run whenever the peer gets to them.
        self.left_posted = False
        self.elapsed_s = 0.0
        # A sender's: the leading pools `KVSender.begin` posted, and every posted operation
        # with the staging tensors it reads, until the worker has waited for them.
        self.begun_pools = 0
        self.posted: list[dist.Work] = []
        self.staging: list[torch.Tensor] = []
        self.phases: dict[str, float] = {}
        self.gpu_phases: dict[str, float] = {}
        self._started = 0.0
        self._events: dict[str, torch.cuda.Event] | None = None
        self._state = TransferState.BOOTSTRAPPING
        self._lock = threading.Lock()
        self._done = threading.Event()

    def start_clock(self, gpu_events: bool = False) -> None:
        """The job starts (on the stream where `gpu_events` are recorded)."""
        self._started = time.perf_counter()
        if gpu_events:
            self._events = {}
            self.mark("started")

    def mark(self, phase: str) -> None:
        """The job reached `phase`: one perf_counter call, cheap enough for every transfer."""
        self.phases[phase] = time.perf_counter() - self._started
        if self._events is not None:
            event = torch.cuda.Event(enable_timing=True)
            torch.cuda.current_stream().record_event(event)
            self._events[phase] = event

    def mark_gpu(self, phase: str) -> None:
        """Record `phase` on the current stream only, when the handle times GPU phases: for a
        point the host does not wait for."""
        if self._events is not None:
            self._events[phase] = torch.cuda.current_stream().record_event(
                torch.cuda.Event(enable_timing=True)
            )

    def time_of(self, phase: str) -> float | None:
        """When the job reached `phase`, on this process's `time.perf_counter` clock; None if
        it did not."""
        at = self.phases.get(phase)
        return None if at is None else self._started + at

    def stop_clock(self, read_gpu_events: bool) -> None:
        """The job ended; reading the GPU events waits for the last one (so only after a job
        that succeeded: a failed one may leave its stream waiting on a receive forever)."""
        self.elapsed_s = time.perf_counter() - self._started
        events, self._events = self._events, None
        if not events or not read_gpu_events:
            return
        first = events["started"]
        try:
            for event in events.values():  # not all on one stream
                event.synchronize()
            self.gpu_phases = {
                phase: first.elapsed_time(event) / 1e3 for phase, event in events.items()
            }
        except RuntimeError:
            # Timings are diagnostics: they never fail a transfer nor stop its worker (a CUDA
            # error here fails the next transfer anyway).
            self.gpu_phases = {}

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def may_still_write(self) -> bool:
        """A receiver's handle: its receives may still write into the slots it was given."""
        return self.left_posted

    @property
    def may_still_read(self) -> bool:
        """A sender's handle: its sends may still read the slots and the row it was given."""
        return self.left_posted

    def advance(self, state: TransferState) -> None:
        with self._lock:
            if self._state in (TransferState.FAILED, TransferState.SUCCESS):
                return
            self._state = max(self._state, state)
            if state == TransferState.SUCCESS:
                self._done.set()

    def fail(self, reason: str) -> None:
        with self._lock:
            if self._state in (TransferState.FAILED, TransferState.SUCCESS):
                return
            self._state = TransferState.FAILED
            self.error = reason
            self._done.set()

    def wait(self, timeout: float | None = None) -> TransferState:
        self._done.wait(timeout)
        return self._state
