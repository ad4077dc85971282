"""The receiving side of the data plane: posts a transfer's receives on the source rank's worker
thread in announcement order, lands the KV in the pools and the row in its metadata row, and
checks the room tag (metadata/transfer.py has the contract).
"""

from __future__ import annotations

import torch

from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.channel import Channel
from metadata.peer_workers import PeerWorkers
from metadata.transfer_handle import TransferHandle, TransferState
from metadata.wire import KVSource, as_bytes, scatter_kv


class KVReceiver(PeerWorkers):
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
