"""The sending side of the data plane: posts a transfer's KV and metadata row to a decode rank on
the caller's thread and stream, and leaves the wait for them to the peer's worker thread
(metadata/transfer.py has the contract).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.peer_workers import PeerWorkers
from metadata.transfer_handle import TransferHandle, TransferState
from metadata.wire import KVSource, PoolMessages, as_bytes, gather_kv


class KVSender(PeerWorkers):
    _role = "kv-sender"
    _sends = True
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
