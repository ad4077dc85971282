"""The bytes of one transfer: which buffers it reads or fills (`KVSource`), where each piece sits
in its single wire buffer (`WireLayout`), and the one-op gather and scatter of a request's KV."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_pool import KVPool
from metadata.buffers import MetadataBuffers


@dataclass(frozen=True)
class KVSource:
    """The buffers of one transfer: what the sender reads, or what the receiver fills.

    `pools_and_slots`: the target pool first, then one per draft depth, each with the slots of
    the request's tokens in that pool; `metadata` and `row`: the request's metadata row.
    `build` validates them and turns each slot list into an index tensor once, on the caller's
    side (numpy parses a Python list several times faster than torch.tensor does)."""

    pools: list[KVPool]
    indices: list[torch.Tensor]  # CPU int64, one per pool
    metadata: MetadataBuffers
    row: int

    @classmethod
    def build(
        cls, pools_and_slots: list[tuple[KVPool, list[int]]], metadata: MetadataBuffers, row: int
    ) -> KVSource:
        if not pools_and_slots:
            raise ValueError("a transfer needs at least the target KV pool")
        if not 0 <= row < metadata.num_rows:
            raise ValueError(f"metadata row {row} out of range [0, {metadata.num_rows})")
        indices = []
        for depth, (pool, slots) in enumerate(pools_and_slots):
            array = np.asarray(slots, dtype=np.int64)
            # Slot 0 is the padding slot: it never holds a request's KV.
            in_range = array.size == 0 or 1 <= array.min() <= array.max() <= pool.capacity
            if array.ndim != 1 or not in_range:
                raise ValueError(f"pool {depth}: slots must lie in [1, {pool.capacity}]")
            indices.append(torch.from_numpy(array))
        return cls([pool for pool, _ in pools_and_slots], indices, metadata, row)

    @property
    def filled(self) -> list[tuple[KVPool, torch.Tensor]]:
        """The pools with at least one slot: an empty pool sends nothing."""
        return [(pool, index) for pool, index in zip(self.pools, self.indices) if len(index)]


# Each segment of the wire buffer starts on this boundary, so every field can be viewed in its
# own dtype (int64 needs 8-byte alignment) without a copy.
_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def kv_shape(pool: KVPool, num_tokens: int) -> tuple[int, ...]:
    """One pool's KV on the wire: [n, num_layers, 2 (K, V), num_kv_heads, head_dim]."""
    return (num_tokens, pool.num_layers, 2, pool.num_kv_heads, pool.head_dim)


class WireLayout:
    """Where each piece of one transfer sits in its single byte buffer: every pool's KV, then the
    metadata row's fields (room last). One buffer means one send and one receive per transfer."""

    def __init__(self, source: KVSource) -> None:
        self.kv: list[tuple[int, tuple[int, ...], torch.dtype]] = []
        offset = 0
        for pool, index in source.filled:
            shape = kv_shape(pool, len(index))
            self.kv.append((offset, shape, pool.dtype))
            offset += _aligned(_numel(shape) * pool.dtype.itemsize)
        self.row: list[tuple[int, torch.Tensor]] = []
        for field in source.metadata.row_tensors(source.row):
            self.row.append((offset, field))
            offset += _aligned(field.numel() * field.element_size())
        self.nbytes = offset

    def kv_view(self, wire: torch.Tensor, i: int) -> torch.Tensor:
        offset, shape, dtype = self.kv[i]
        size = _numel(shape) * dtype.itemsize
        return wire[offset : offset + size].view(dtype).view(shape)

    def row_views(self, wire: torch.Tensor) -> list[torch.Tensor]:
        return [
            wire[o : o + f.numel() * f.element_size()].view(f.dtype).view(f.shape)
            for o, f in self.row
        ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _index(pool: KVPool, slots: list[int] | torch.Tensor) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor):
        slots = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    return slots.to(pool.device, non_blocking=True)


def gather_kv(
    pool: KVPool, slots: list[int] | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every layer's K and V at `slots` (see `kv_shape`), into `out` when given."""
    return torch.index_select(pool.kv_buffer, 0, _index(pool, slots), out=out)


def scatter_kv(pool: KVPool, slots: list[int] | torch.Tensor, kv: torch.Tensor) -> None:
    pool.kv_buffer.index_copy_(0, _index(pool, slots), kv)
