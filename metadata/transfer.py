"""The data plane: a request's KV (target pool, then each draft depth's pool) and its metadata row,
moved from a prefill rank to a decode rank with torch.distributed p2p (NCCL on GPU, gloo on CPU).

Contract (the control plane keeps it; tests/test_transfer.py checks the data plane's side):
- the prefill node announces each transfer (room, number of tokens) before `KVSender.send`; the
  decode node calls `KVReceiver.expect` in announcement order per source rank, with slot lists of
  the announced length. NCCL matches p2p operations by order alone, so both sides must post one
  order per pair (gloo also matches the tag, derived from the room; NCCL ignores it);
- one FIFO worker thread per peer rank on each side: transfers to (from) different peers never
  wait on each other, and each pair keeps the one order;
- on the wire, ONE byte buffer per transfer (`WireLayout`): per pool the KV gathered as
  [n, num_layers, 2 (K, V), num_kv_heads, head_dim], then the metadata row's bytes
  (`MetadataBuffers.row_bytes`: its fields in `FIELDS` order, room last). One send and one
  receive per transfer; only tensors travel: no pickle;
- a handle is SUCCESS only once everything landed (on CUDA: the side stream synchronized) and the
  received room tag matches; the caller keeps the slots and the row untouched until the handle is
  terminal, then frees them (sender) or uses them (receiver);
- a posted p2p operation cannot be cancelled (NCCL; and a gloo wait that times out closes every
  pair of the process group, so none is used). Hence: every announced transfer must be sent, a
  transfer that misses its deadline breaks the channel with that peer for good on both backends
  (later ones fail at once; other peers are unaffected; recovery is a new group), and a handle
  may be failed by the caller (`handle.fail`) only while it is still queued and only if the peer
  will not send it either (TransferAbandoned);
- `connect(peer)` on both sides, before the first transfer, opens the channel (NCCL creates the
  pair's communicator then, blocking until both ranks join).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from engine.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.wire import KVSource, WireLayout, gather_kv, scatter_kv


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

    `phases`: host seconds from the worker starting the job to each phase it reached, in order:
    a sender's "ready" (its stream waits for the caller's KV), "gathered" (the KV gathers and the
    row copy enqueued), "posted" (isend returned), "completed" (the send done); a receiver's
    "posted" (irecv returned), "landed" (the receive done), "scattered" (scatters and the row
    copy enqueued), "synced" (they ran). `gpu_phases`: the same phases on the worker's stream,
    in seconds since the job's first event, only from workers made with `phase_events`."""

    def __init__(self, room: int, peer: int, timeout_s: float = 120.0) -> None:
        self.room = room
        self.peer = peer
        self.timeout_s = timeout_s  # how long the transfer may take once its worker starts it
        self.error: str | None = None
        self.nbytes = 0
        self.elapsed_s = 0.0
        self.phases: dict[str, float] = {}
        self.gpu_phases: dict[str, float] = {}
        self._started = 0.0
        self._events: dict[str, torch.cuda.Event] | None = None
        self._state = TransferState.BOOTSTRAPPING
        self._lock = threading.Lock()
        self._done = threading.Event()

    def start_clock(self, gpu_events: bool = False) -> None:
        """The worker starts the job, on its stream (where `gpu_events` are recorded)."""
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

    def stop_clock(self, read_gpu_events: bool) -> None:
        """The job ended; reading the GPU events waits for the last one (so only after a job
        that succeeded: a failed one may leave its stream waiting on a receive forever)."""
        self.elapsed_s = time.perf_counter() - self._started
        events, self._events = self._events, None
        if not events or not read_gpu_events:
            return
        first, last = events["started"], list(events.values())[-1]
        try:
            last.synchronize()
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


def _tag(room: int) -> int:
    # gloo tags are non-negative 32-bit ints; rooms are 63-bit. A collision needs two in-flight
    # rooms of one pair 2**31 apart, and even then the order of posting still matches them.
    return room & 0x7FFFFFFF


_CLOSE = object()
_SPIN_S = 0.005
_NO_DEADLINE = timedelta(days=365)
_CONNECT_TAG = 0  # rooms start at 1; see _tag for the (ordered) case of a collision


class _PeerWorkers:
    """One FIFO worker thread per peer rank, created on first use."""

    _role = "kv-channel"

    def __init__(
        self, device: str | torch.device, timeout_s: float = 120.0, phase_events: bool = False
    ) -> None:
        """`phase_events`: also time each transfer's phases with CUDA events (`gpu_phases`), at
        the cost of one event per phase and a wait for the last one: for benchmarks."""
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._is_cuda = self.device.type == "cuda"
        self.phase_events = phase_events and self._is_cuda
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        # Peers whose channel a timeout left out of order, with the reason (see `_wait`).
        self._broken: dict[int, str] = {}

    def connect(self, peer: int) -> TransferHandle:
        """Open the channel with `peer` before its first transfer; both sides call it, first.

        NCCL creates a pair's communicator on its first operation, blocking until both ranks
        join: doing it at pairing time keeps that cost and that wait out of the first request."""
        handle = TransferHandle(room=0, peer=peer, timeout_s=self.timeout_s)
        sending = isinstance(self, KVSender)
        token = torch.tensor([dist.get_rank() if sending else -1], device=self.device)

        def exchange() -> str | None:
            post = dist.isend if sending else dist.irecv
            self._wait(handle, [post(token, peer, tag=_CONNECT_TAG)])
            if sending or int(token) == peer:
                return None
            return f"connect: rank {peer} announced itself as rank {int(token)}"

        self._submit(peer, handle, exchange)
        return handle

    def _submit(self, peer: int, handle: TransferHandle, job: Callable[[], str | None]) -> None:
        """Queue `job` behind the peer's earlier transfers; it returns None or why it failed."""
        # Checked here because gloo crashes the process (SIGSEGV) on a p2p op to a bad rank.
        world, own = dist.get_world_size(), dist.get_rank()
        if not 0 <= peer < world or peer == own:
            raise ValueError(
                f"peer rank {peer} is not another rank of this world (size {world}, "
                f"this is rank {own})"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._role} is closed")
            jobs = self._queues.get(peer)
            if jobs is None:
                jobs = self._queues[peer] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._serve, args=(peer, jobs), name=f"{self._role}-{peer}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        handle.advance(TransferState.WAITING)
        jobs.put((handle, job))

    def _serve(self, peer: int, jobs: queue.SimpleQueue) -> None:
        if self._is_cuda:
            # The current device and stream are per thread: set once, they hold for every job
            # (a `torch.cuda.stream` context per job costs tens of microseconds of Python).
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        while (item := jobs.get()) is not _CLOSE:
            handle, job = item
            if handle.state == TransferState.FAILED:
                continue  # failed by the caller while queued: nothing was posted for it
            if self._closed:
                handle.fail(f"room {handle.room}: {self._role} closed before the transfer ran")
                continue
            handle.advance(TransferState.TRANSFERRING)
            try:
                handle.start_clock(gpu_events=self.phase_events)
                if peer in self._broken:
                    raise RuntimeError(self._broken[peer])
                failure = job()
            except Exception as err:  # any failure is the transfer's, never the worker's
                failure = f"room {handle.room}, peer rank {peer}: {type(err).__name__}: {err}"
            handle.stop_clock(read_gpu_events=failure is None)
            if failure is None:
                handle.advance(TransferState.SUCCESS)
            else:
                handle.fail(failure)

    def _wait(self, handle: TransferHandle, works: list[dist.Work]) -> None:
        """Wait for `works` up to the deadline. A timeout leaves the operations posted (neither
        backend can cancel one), so the channel to `peer` is marked broken for good."""
        peer, deadline = handle.peer, time.monotonic() + handle.timeout_s
        if self._is_cuda:
            # WorkNCCL.wait() only orders streams; poll to learn completion, with a bound.
            # Yield the interpreter without sleeping for the first moments (most transfers end
            # within a millisecond, and a sleep's wake-up costs ~100 us), then back off.
            spin_until = time.monotonic() + _SPIN_S
            for work in works:
                while not work.is_completed():
                    now = time.monotonic()
                    if now > deadline:
                        self._break(handle)
                    time.sleep(0 if now < spin_until else 50e-6)
                work.wait()
            return
        # gloo: a timed Work.wait() that expires closes EVERY pair of the process group, and
        # gloo's is_completed() stays False until someone waits. So a helper thread waits
        # without a deadline, and the deadline is kept here; on expiry the helper stays parked
        # (holding the buffers, which the posted operation may still write) until data comes.
        finished, errors = threading.Event(), []

        def wait_all() -> None:
            try:
                for work in works:
                    work.wait(timeout=_NO_DEADLINE)
            except Exception as err:
                errors.append(err)
            finally:
                finished.set()

        threading.Thread(target=wait_all, name=f"{self._role}-wait-{peer}", daemon=True).start()
        if not finished.wait(handle.timeout_s):
            self._break(handle)
        if errors:
            raise errors[0]

    def _break(self, handle: TransferHandle) -> None:
        peer = handle.peer
        self._broken[peer] = (
            f"channel to rank {peer} unusable since room {handle.room} timed out (its operations "
            "are still posted and would take the next transfer's data)"
        )
        raise TimeoutError(
            f"rank {peer} did not complete the transfer within {handle.timeout_s:g} s"
        )

    def close(self, join_timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
        for jobs in queues:
            jobs.put(_CLOSE)
        for thread in self._threads:
            thread.join(join_timeout_s)


class KVSender(_PeerWorkers):
    _role = "kv-sender"

    def send(
        self,
        dst_rank: int,
        room: int,
        pools_and_slots: list[tuple[KVPool, list[int]]],
        metadata: MetadataBuffers,
        row: int,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Queue one transfer to `dst_rank`; `timeout_s` overrides the sender's deadline."""
        source = KVSource.build(pools_and_slots, metadata, row)
        handle = TransferHandle(room, dst_rank, self.timeout_s if timeout_s is None else timeout_s)
        # The KV and the row were written on the caller's stream: the side stream waits for it.
        ready = torch.cuda.current_stream().record_event() if self._is_cuda else None
        self._submit(dst_rank, handle, lambda: self._send(dst_rank, handle, source, ready))
        return handle

    def _send(
        self, dst: int, handle: TransferHandle, source: KVSource, ready: torch.cuda.Event | None
    ) -> str | None:
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        handle.mark("ready")
        layout = WireLayout(source)
        wire = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        for i, (pool, index) in enumerate(source.filled):
            gather_kv(pool, index, layout.kv_view(wire, i))
        layout.row_view(wire).copy_(source.metadata.row_bytes(source.row))
        handle.nbytes = layout.nbytes
        handle.mark("gathered")
        work = dist.isend(wire, dst, tag=_tag(handle.room))
        handle.mark("posted")
        self._wait(handle, [work])
        handle.mark("completed")
        return None


class KVReceiver(_PeerWorkers):
    _role = "kv-receiver"

    def expect(
        self,
        src_rank: int,
        room: int,
        pools_and_slots: list[tuple[KVPool, list[int]]],
        metadata: MetadataBuffers,
        row: int,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Post the receives of one announced transfer; call in announcement order per source.
        `timeout_s` overrides the receiver's deadline (e.g. to scale it with the size)."""
        target = KVSource.build(pools_and_slots, metadata, row)
        handle = TransferHandle(room, src_rank, self.timeout_s if timeout_s is None else timeout_s)
        self._submit(src_rank, handle, lambda: self._receive(src_rank, handle, target))
        return handle

    def _receive(self, src: int, handle: TransferHandle, target: KVSource) -> str | None:
        # Everything lands in a staging buffer first, so that a late or partial transfer never
        # writes into slots or a row since handed to another request, and the row (room tag
        # included) lands after all of the KV.
        layout = WireLayout(target)
        wire = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        handle.nbytes = layout.nbytes
        work = dist.irecv(wire, src, tag=_tag(handle.room))
        handle.mark("posted")
        self._wait(handle, [work])
        handle.mark("landed")
        for i, (pool, index) in enumerate(target.filled):
            scatter_kv(pool, index, layout.kv_view(wire, i))
        # One copy of the whole row: the room tag is checked below, once it has completed.
        target.metadata.row_bytes(target.row).copy_(layout.row_view(wire))
        handle.mark("scattered")
        if self._is_cuda:
            torch.cuda.current_stream().synchronize()
        handle.mark("synced")
        if not target.metadata.row_landed(target.row, handle.room):
            got = int(target.metadata.room[target.row])
            return f"room tag mismatch: expected {handle.room} got {got} (from rank {src})"
        return None
