"""The data plane: a request's KV (target pool, then each draft depth's pool) and its metadata row,
moved from a prefill rank to a decode rank with torch.distributed p2p (NCCL on GPU, gloo on CPU).

Contract (the control plane keeps it; tests/test_transfer.py checks the data plane's side):
- the prefill node announces each transfer (room, number of tokens) before `KVSender.send`
  (right before the forward that completes the request's prompt, so that the receives are
  posted by the time the forward is done), and sends it in the same step; the decode node
  calls `KVReceiver.expect` in announcement order per source rank, with slot lists of the
  announced length. A receive's deadline hence covers the
  prefill's forward too. NCCL matches p2p operations by order alone, so both sides must post one
  order per pair (gloo also matches the tag, derived from the room; NCCL ignores it);
- the sender posts on the caller's thread and stream (the serving thread: one thread, so one
  order per pair); the receiver posts on a FIFO worker thread per source rank, in the order of
  the `expect` calls. On each side one worker thread per peer waits for the posted operations
  and finishes the transfer: transfers to (from) different peers never wait on each other;
- on the wire, one message per pool with at least one slot, its KV as
  [n, num_layers, 2 (K, V), num_kv_heads, head_dim] bytes, in pool order, then one message with
  the metadata row's bytes (`MetadataBuffers.row_bytes`: its fields in `FIELDS` order, room
  last); all of one transfer's messages are posted as one batch (`batch_isend_irecv`, one NCCL
  group) with one tag. Only tensors travel: no pickle;
- each side reads (fills) a pool straight from (into) the pool when ITS slots there are one
  ascending contiguous run, else through a staging tensor (gather before sending, scatter after
  landing). Message sizes do not depend on that choice, so each side makes it alone (`KVSource`);
- the receiver lands the row in a staging tensor and copies it into its row after everything
  landed: the room tag is checked once that copy completed, and a late receive never writes a
  row handed to another request;
- a handle is SUCCESS only once everything landed (on CUDA: the side stream synchronized) and the
  received room tag matches; the caller keeps the slots and the row untouched until the handle is
  terminal, then frees them (sender) or uses them (receiver). Except after a timeout
  (`handle.may_still_write` on the receiver, `handle.may_still_read` on the sender): the
  transfer's operations stay posted and may still fill the receiver's slots or read the sender's
  slots and row whenever the peer gets to them, so those must never be handed to another request;
- a posted p2p operation cannot be cancelled (NCCL; and a gloo wait that times out closes every
  pair of the process group, so none is used). Hence: every announced transfer must be sent, a
  transfer that misses its deadline breaks the channel with that peer for good on both backends
  (later ones fail at once; other peers are unaffected; recovery is a new pair group: `attach`),
  and a handle may be failed by the caller (`handle.fail`) only while it is still queued and only
  if the peer will not send it either (TransferAbandoned);
- `connect(peer)` on both sides, before the first transfer, opens the channel (NCCL creates the
  pair's communicator then, blocking until both ranks join). On NCCL each pair has its own
  two-rank process group: a batch of p2p operations on a group runs on that group's
  communicator, which for the whole world would need every rank to join, and a group's batch
  state is not safe to share between the worker threads of several peers;
- the cluster's nodes give each peer a channel of its own (`attach`, metadata.pair_group): a
  pair group that no other pair shares. Attaching a new channel for a peer (the peer was
  replaced) starts a new worker for it; what was queued for the old channel fails, and a job the
  old worker is still waiting on fails when the dead peer's sockets close (gloo) or its
  communicator is aborted (NCCL). A peer reported dead (`forget_peer`) fails whatever is queued
  for it and every later transfer with it at once, until a channel is attached again. Without
  `attach`, channels are made on the process's default group (`channel_to`), as two-process
  tests do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.channel import Channel, channel_to
from metadata.transfer_handle import TransferHandle, TransferState
from metadata.wire import KVSource, PoolMessages, as_bytes, gather_kv, scatter_kv


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
        sending = isinstance(self, KVSender)
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


class KVSender(_PeerWorkers):
    _role = "kv-sender"
    _timing_stream: torch.cuda.Stream | None = None

    def begin(
        self,
        dst_rank: int,
        room: int,
        messages: PoolMessages,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Post the leading pools of a transfer (the target's KV) now, as soon as the forward
        that writes them is enqueued, before the rest of the transfer (the draft depths' KV,
        the row with the first token) exists. The sends wait on the GPU for the caller's
        stream, so the host's cost of posting them overlaps the end of the forward, and the KV
        moves as soon as it is there. The peer receives one transfer all the same: finish it
        with `send(..., begun=handle)`, which posts the rest, whatever happens in between.
        `messages` (`PoolMessages.build`, before the forward) are the leading pools'."""
        self._channel(dst_rank)  # a rank outside the world is the caller's error
        handle = self._new_handle(room, dst_rank, timeout_s)
        handle.start_clock(gpu_events=self.phase_events)
        handle.nbytes = messages.nbytes
        self._post(handle, messages.pieces, None)
        handle.begun_pools = messages.num_pools
        if self.phase_events and handle.posted:
            # "kv_sent": when these sends end, on a stream that waits for them on the GPU (the
            # host waits for nothing): with "started" (the caller's stream when the forward was
            # enqueued), the GPU time from the KV being ready to it being sent.
            if self._timing_stream is None:
                self._timing_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._timing_stream):
                for work in handle.posted:
                    work.wait()
                handle.mark_gpu("kv_sent")
        return handle

    def send(
        self,
        dst_rank: int,
        room: int,
        pools_and_slots: list[tuple[KVPool, list[int]]],
        metadata: MetadataBuffers,
        row: int,
        timeout_s: float | None = None,
        begun: TransferHandle | None = None,
    ) -> TransferHandle:
        """Post one transfer to `dst_rank` now, on the caller's thread and stream (so the sends
        follow the caller's writes of the KV and the row), and leave its completion to the
        peer's worker; `timeout_s` overrides the sender's deadline. With `begun` (from `begin`,
        for the same peer and room), the pools it posted are left out and its handle returned.

        The caller's thread posts because a worker thread must first get the interpreter from
        it: in a busy node that hand-off cost more than the posting itself. Posting from one
        thread also keeps one order per peer, which NCCL needs."""
        skip = 0 if begun is None else begun.begun_pools
        try:
            if begun is not None and (begun.peer, begun.room) != (dst_rank, room):
                raise ValueError(
                    f"room {room} to rank {dst_rank} finishes the transfer begun for room "
                    f"{begun.room} to rank {begun.peer}"
                )
            source = KVSource.build(pools_and_slots, metadata, row, skip=skip)
            self._channel(dst_rank)  # a rank outside the world is the caller's error
        except Exception as err:
            if begun is not None and begun.posted:
                # The caller's error, but the begun sends stay posted, their transfer unfinished.
                begun.left_posted = True
                begun.fail(f"room {room}, peer rank {dst_rank}: {type(err).__name__}: {err}")
            raise
        if begun is not None and begun.state == TransferState.FAILED and not begun.posted:
            # Nothing of it went out: post the whole transfer.
            begun, source = None, KVSource.build(pools_and_slots, metadata, row)
        handle = begun
        if handle is None:
            handle = self._new_handle(room, dst_rank, timeout_s)
            handle.start_clock(gpu_events=self.phase_events)
        handle.nbytes += source.nbytes
        self._post(handle, source.filled, source.row_bytes, stand_in=True)
        if handle.state != TransferState.FAILED:
            works, staging = handle.posted, handle.staging
            try:
                self._submit(dst_rank, handle, lambda: self._complete(handle, works, staging))
            except RuntimeError as err:  # closed meanwhile: nobody will wait for the sends
                handle.left_posted = True
                handle.fail(f"room {room}, peer rank {dst_rank}: {err}")
        # A failed part after another went out leaves the transfer's sends unwaited for: the
        # handle says they may still read the slots (`may_still_read`).
        return handle

    def _post(
        self,
        handle: TransferHandle,
        pieces: tuple,
        row_bytes: torch.Tensor | None,
        stand_in: bool = False,
    ) -> None:
        """Post `pieces` (then `row_bytes`) for `handle`; a failure fails the handle (and says
        whether an earlier part stays posted), never the caller. With `stand_in`, a part that
        fails before it is posted goes out as zeros of its messages' sizes: the peer posted
        receives for the whole announced transfer, and the pair's next transfer must not take
        their place. Its row of zeros carries room tag 0, which fails the transfer there."""
        peer, room = handle.peer, handle.room
        if handle.state == TransferState.FAILED and not stand_in:
            return
        channel = self._channel(peer)  # checked by the caller
        try:
            if handle.state == TransferState.FAILED:
                raise RuntimeError(handle.error)
            if self._closed:
                raise RuntimeError(f"{self._role} is closed")
            if peer in self._broken:
                raise RuntimeError(self._broken[peer])
            buffers = []
            for piece in pieces:
                if piece.direct is None:
                    staged = gather_kv(piece.pool, piece.index, piece.staging())
                    handle.staging.append(staged)
                    buffers.append(as_bytes(staged))
                    handle.staged += 1
                else:
                    buffers.append(piece.direct)
            if row_bytes is not None:
                # The row goes as it is: the caller leaves it alone until the handle is terminal.
                buffers.append(row_bytes)
                handle.mark("gathered")
            if self.host_staged:
                # A blocking copy on the caller's stream: it follows the forward's writes.
                buffers = [buffer.to("cpu").contiguous() for buffer in buffers]
                handle.staging += buffers
        except Exception as err:
            handle.left_posted = bool(handle.posted)
            handle.fail(f"room {room}, peer rank {peer}: {type(err).__name__}: {err}")
            handle.stop_clock(read_gpu_events=False)
            if stand_in and not self._closed and peer not in self._broken:
                sizes = [piece.nbytes for piece in pieces]
                sizes += [] if row_bytes is None else [row_bytes.numel()]
                zeros = [torch.zeros(n, dtype=torch.uint8, device=self._wire_device) for n in sizes]
                handle.staging += zeros
                self._post_batch(channel, handle, True, zeros)
            return
        self._post_batch(channel, handle, True, buffers)
        if handle.state != TransferState.FAILED:
            handle.mark("posted" if row_bytes is not None else "begun")
            handle.advance(TransferState.TRANSFERRING)

    def _complete(
        self, handle: TransferHandle, works: list[dist.Work], staging: list[torch.Tensor]
    ) -> str | None:
        """`staging` rides along: the sends read it until they complete."""
        self._wait(handle, works)
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
        channel = self._channel(src_rank)
        handle = self._new_handle(room, src_rank, timeout_s)
        self._submit(src_rank, handle, lambda: self._receive(channel, handle, target))
        return handle

    def discard(
        self,
        src_rank: int,
        room: int,
        message_nbytes: list[int],
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Post the receives of an announced transfer that no request takes (a room the node
        no longer knows, or an announcement it refuses) into scratch bytes of the messages'
        sizes, then drop them. The sender sends every announced transfer, and NCCL matches a
        pair's operations by order alone: without these receives, the pair's next transfer
        would take this one's data. Call in announcement order, as `expect`."""
        channel = self._channel(src_rank)
        handle = self._new_handle(room, src_rank, timeout_s)

        def receive_into_scratch() -> str | None:
            buffers = [
                torch.empty(n, dtype=torch.uint8, device=self._wire_device) for n in message_nbytes
            ]
            handle.nbytes = sum(message_nbytes)
            self._post_batch(channel, handle, False, buffers)
            if handle.state == TransferState.FAILED:
                return handle.error
            self._wait(handle, handle.posted)
            handle.mark("landed")
            return None

        self._submit(src_rank, handle, receive_into_scratch)
        return handle

    def _receive(self, channel: Channel, handle: TransferHandle, target: KVSource) -> str | None:
        buffers, staged = [], []
        for piece in target.filled:
            if piece.direct is None:
                kv = piece.staging()
                staged.append((piece, kv))
                buffers.append(as_bytes(kv))
            else:
                buffers.append(piece.direct)
        # The row lands apart and is copied in whole once everything landed: the room tag then
        # vouches for the row and the KV, and a receive left posted by a timeout never writes
        # a row handed to another request since.
        row = torch.empty_like(target.row_bytes)
        buffers.append(row)
        handle.nbytes = target.nbytes
        handle.staged = len(staged)
        on_wire = buffers
        if self.host_staged:
            on_wire = [torch.empty(b.shape, dtype=b.dtype, device="cpu") for b in buffers]
        self._post_batch(channel, handle, False, on_wire)
        if handle.state == TransferState.FAILED:
            return handle.error
        works = handle.posted
        handle.mark("posted")
        self._wait(handle, works)
        handle.mark("landed")
        if self.host_staged:
            for buffer, landed in zip(buffers, on_wire):
                buffer.copy_(landed)
        for piece, kv in staged:
            scatter_kv(piece.pool, piece.index, kv)
        target.row_bytes.copy_(row)
        handle.mark("scattered")
        if self._is_cuda:
            torch.cuda.current_stream().synchronize()
        handle.mark("synced")
        if not target.metadata.row_landed(target.row, handle.room):
            got = int(target.metadata.room[target.row])
            return f"room tag mismatch: expected {handle.room} got {got} (from rank {handle.peer})"
        return None
