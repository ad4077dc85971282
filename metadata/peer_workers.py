"""The worker-thread machinery the KV sender and receiver share: one FIFO worker thread per peer
rank, the peer's channel, and the bounded wait for posted p2p operations (a timeout breaks the
channel for good, since neither backend can cancel a posted operation). The contract both sides
keep is in metadata/transfer.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from metadata.channel import Channel, channel_to
from metadata.transfer_handle import TransferHandle, TransferState


def _tag(room: int) -> int:
    # gloo tags are non-negative 32-bit ints; rooms are 63-bit. A collision needs two in-flight
    # rooms of one pair 2**31 apart, and even then the order of posting still matches them.
    return room & 0x7FFFFFFF


_CLOSE = object()
_SPIN_S = 0.005
_NO_DEADLINE = timedelta(days=365)
_CONNECT_TAG = 0  # rooms start at 1; see _tag for the (ordered) case of a collision


class PeerWorkers:
    """One FIFO worker thread per peer rank, created on first use."""

    _role = "kv-channel"
    _sends = False  # which end of the channel this side posts: sends or receives

    def __init__(
        self,
        device: str | torch.device,
        timeout_s: float = 120.0,
        phase_events: bool = False,
        host_staged: bool = False,
        rank: int | None = None,
    ) -> None:
        """`rank`: this process's rank among the cluster's nodes; None: its rank in the default
        group (channels then made by `channel_to`).
        `phase_events`: also time each transfer's phases with CUDA events (`gpu_phases`), at
        the cost of one event per phase and a wait for the last one: for benchmarks.
        `host_staged`: the group is gloo although the pools are on a GPU (the two nodes share
        one GPU, which NCCL refuses to pair with itself): every message crosses through host
        memory, copied out before the send and in after the receive."""
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._is_cuda = self.device.type == "cuda"
        self.host_staged = host_staged
        self._nccl = self._is_cuda and not host_staged
        # Where the buffers handed to the process group live.
        self._wire_device = torch.device("cpu") if host_staged else self.device
        self.phase_events = phase_events and self._nccl
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        # Peers whose channel a timeout left out of order, with the reason (see `_wait`).
        self._broken: dict[int, str] = {}
        self._channels: dict[int, Channel] = {}
        self._rank = rank
        # Peers reported dead (`forget_peer`): their channel is gone, not broken by a timeout.
        self._lost: set[int] = set()
        # Per peer, which worker serves it now: a peer's channel replaced (`attach`) leaves the
        # old worker to fail what it still holds.
        self._generation: dict[int, int] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank() if self._rank is None else self._rank

    def attach(self, peer: int, channel: Channel) -> None:
        """Use `channel` for `peer` from now on (a new pair group: the peer is new, or was
        replaced). Transfers queued for the old channel fail; the peer's broken mark goes."""
        with self._lock:
            old = self._channels.get(peer)
            self._channels[peer] = channel
            self._broken.pop(peer, None)
            self._lost.discard(peer)
            jobs = self._queues.pop(peer, None)
            self._generation[peer] = self._generation.get(peer, 0) + 1
        if jobs is not None:
            jobs.put(_CLOSE)
        if old is not None and old is not channel:
            old.close()

    def forget_peer(self, peer: int, reason: str) -> None:
        """The peer is gone: transfers with it fail at once (queued or new) until a new
        channel is attached."""
        with self._lock:
            self._broken[peer] = reason
            self._lost.add(peer)
            jobs = self._queues.pop(peer, None)
            self._generation[peer] = self._generation.get(peer, 0) + 1
        if jobs is not None:
            jobs.put(_CLOSE)

    def broken_peers(self) -> dict[int, str]:
        """Live peers whose channel a timeout (or a failed post) left out of order, with why."""
        return {peer: why for peer, why in self._broken.items() if peer not in self._lost}

    def connect(self, peer: int) -> TransferHandle:
        """Open the channel with `peer` before its first transfer; both sides call it, first.

        NCCL creates a pair's communicator on its first operation, blocking until both ranks
        join: doing it at pairing time keeps that cost and that wait out of the first request."""
        channel = self._channel(peer)
        handle = TransferHandle(room=0, peer=peer, timeout_s=self.timeout_s)
        sending = self._sends
        token = torch.tensor([self.rank if sending else -1], device=self._wire_device)

        def exchange() -> str | None:
            self._wait(handle, channel.post(sending, peer, _CONNECT_TAG, [token]))
            if sending or int(token) == peer:
                return None
            return f"connect: rank {peer} announced itself as rank {int(token)}"

        self._submit(peer, handle, exchange)
        return handle

    def _channel(self, peer: int) -> Channel:
        channel = self._channels.get(peer)
        if channel is not None:
            return channel
        if self._rank is not None:
            raise ValueError(f"rank {peer} is not a peer of rank {self._rank} (no channel)")
        # Checked first because gloo crashes the process (SIGSEGV) on a p2p op to a bad rank.
        world, own = dist.get_world_size(), dist.get_rank()
        if not 0 <= peer < world or peer == own:
            raise ValueError(
                f"peer rank {peer} is not another rank of this world (size {world}, "
                f"this is rank {own})"
            )
        channel = self._channels[peer] = channel_to(peer, nccl=self._nccl)
        return channel

    def _submit(self, peer: int, handle: TransferHandle, job: Callable[[], str | None]) -> None:
        """Queue `job` behind the peer's earlier transfers; it returns None or why it failed.
        The caller has checked `peer` (`_channel`)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._role} is closed")
            jobs = self._queues.get(peer)
            if jobs is None:
                jobs = self._queues[peer] = queue.SimpleQueue()
                generation = self._generation.get(peer, 0)
                thread = threading.Thread(
                    target=self._serve,
                    args=(peer, jobs, generation),
                    name=f"{self._role}-{peer}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
        handle.advance(TransferState.WAITING)  # a posted handle stays TRANSFERRING
        jobs.put((handle, job))

    def _new_handle(self, room: int, peer: int, timeout_s: float | None) -> TransferHandle:
        """`timeout_s` overrides this side's deadline."""
        return TransferHandle(room, peer, self.timeout_s if timeout_s is None else timeout_s)

    def _post_batch(
        self, channel: Channel, handle: TransferHandle, sending: bool, buffers: list
    ) -> None:
        """Post `buffers` for `handle` (added to `handle.posted`). A batch that fails part way
        may have posted some of it: the channel to the peer is then out of order for good."""
        try:
            handle.posted += channel.post(sending, handle.peer, _tag(handle.room), buffers)
        except Exception as err:
            peer = handle.peer
            self._broken[peer] = (
                f"channel to rank {peer} unusable since posting room {handle.room} failed: "
                f"{type(err).__name__}: {err}"
            )
            handle.left_posted = True
            handle.fail(f"room {handle.room}, peer rank {peer}: {self._broken[peer]}")

    def break_channel(self, peer: int, reason: str) -> None:
        """Mark the channel to `peer` out of order for good (later transfers fail at once)."""
        self._broken.setdefault(peer, f"channel to rank {peer} unusable: {reason}")

    def _serve(self, peer: int, jobs: queue.SimpleQueue, generation: int = 0) -> None:
        if self._is_cuda:
            # The current device and stream are per thread: set once, they hold for every job
            # (a `torch.cuda.stream` context per job costs tens of microseconds of Python).
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        while (item := jobs.get()) is not _CLOSE:
            handle, job = item
            if handle.state == TransferState.FAILED:
                continue  # failed by the caller while queued: nothing was posted for it
            if self._closed and handle.state != TransferState.TRANSFERRING:
                handle.fail(f"room {handle.room}: {self._role} closed before the transfer ran")
                continue
            if self._generation.get(peer, 0) != generation:
                # The peer was lost or replaced while this waited: its channel is gone.
                reason = self._broken.get(peer, f"the channel with rank {peer} was replaced")
                if handle.state == TransferState.TRANSFERRING:
                    handle.left_posted = True
                handle.fail(f"room {handle.room}, peer rank {peer}: {reason}")
                continue
            posted = handle.state == TransferState.TRANSFERRING  # by the caller (a sender)
            handle.advance(TransferState.TRANSFERRING)
            try:
                if not posted:
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
        if self._nccl:
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
        handle.left_posted = True
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
        if self._rank is not None:  # the pair groups are this object's (`attach`)
            for channel in list(self._channels.values()):
                channel.close()
