"""How a process posts p2p operations to one peer rank (`Channel`), one batch at a time, on the
pair's own process group under NCCL or on the default group under gloo. metadata.peer_workers
keeps the order and the deadlines; this module only posts."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


class Channel:
    """How this process posts p2p operations to one peer: on which process group (None: the
    default one), one batch at a time."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        peer_in_group: int | None = None,
        coalesce: bool | None = None,
    ) -> None:
        """`coalesce`: post a batch as one coalesced NCCL group; None: when the group can (the
        pair groups `dist.new_group` makes under NCCL). A gloo pair group posts plain sends and
        receives, one per buffer."""
        self.group = group
        self.peer_in_group = peer_in_group
        if coalesce is None:
            coalesce = group is not None and hasattr(group, "_start_coalescing")
        self.coalesce = coalesce
        # A group's batch state is per process: a sender and a receiver of one process that
        # share a peer take turns.
        self.lock = threading.Lock()

    def post(self, sending: bool, peer: int, tag: int, buffers: list[torch.Tensor]) -> list:
        """Post one batch of sends (receives) of `buffers` to (from) `peer`."""
        with self.lock:
            group = self.group
            if group is not None and self.coalesce:
                # The pair's own NCCL group: the coalesced batch batch_isend_irecv makes, built
                # straight on the process group, without its Python checks per operation.
                device = buffers[0].device
                group._start_coalescing(device)
                try:
                    for buffer in buffers:
                        if sending:
                            group.send([buffer], self.peer_in_group, tag)
                        else:
                            group.recv([buffer], self.peer_in_group, tag)
                finally:
                    # Always closed: an open batch would hold back every later operation.
                    work = group._end_coalescing(device)
                return [work]
            if group is not None:
                # A pair group of this process's own (metadata.pair_group), not registered
                # with torch.distributed: posted on the group object itself.
                post = group.send if sending else group.recv
                return [post([buffer], self.peer_in_group, tag) for buffer in buffers]
            op = dist.isend if sending else dist.irecv
            ops = [dist.P2POp(op, buffer, peer, group, tag) for buffer in buffers]
            return dist.batch_isend_irecv(ops)

    def close(self) -> None:
        """Abort the pair's communicator where the backend can (NCCL: kernels still posted for
        a dead peer would otherwise spin on the GPU forever); a gloo pair is left to close with
        the peer's process, which fails whatever is still posted."""
        group = self.group
        if group is not None and self.coalesce and hasattr(group, "abort"):
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort on a channel already given up
                pass


_process_channels: dict[tuple[object, int], Channel] = {}
_process_channels_lock = threading.Lock()


def channel_to(peer: int, nccl: bool) -> Channel:
    """The channel with `peer` in this process's current group, made on first use. NCCL gets a
    group of just the pair (made by the two ranks alone; its communicator comes with its first
    batch): a batch runs on its group's communicator, which for the default group would wait
    for every rank of the world to join it. gloo runs a batch as plain sends and receives, on
    the default group."""
    key = (dist.distributed_c10d._get_default_group(), peer)
    with _process_channels_lock:
        channel = _process_channels.get(key)
        if channel is None:
            group, peer_in_group = None, None
            if nccl:
                pair = sorted((dist.get_rank(), peer))
                group = dist.new_group(pair, use_local_synchronization=True)
                peer_in_group = pair.index(peer)
            channel = _process_channels[key] = Channel(group, peer_in_group)
        return channel
