"""The bytes of one transfer: which buffers it reads or fills (`KVSource`), where each piece sits
in its single wire buffer (`WireLayout`), and the one-op gather and scatter of a request's KV."""

from __future__ import annotations

import math
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
    indices: list[torch.Tensor]  # CPU int64, one per pool; pinned for a CUDA pool
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
            index = torch.from_numpy(array)
            if pool.device.type == "cuda" and array.size:
                # Pinned, so that the worker's copy of the index to the GPU is asynchronous: a
                # copy from pageable memory first waits on the host for the worker's stream,
                # that is for the caller's KV (the ready event) and all queued before it. The
                # copy stays on the worker's stream with the gather that reads the index (a
                # device index made here, on the caller's stream, would have to be fenced and
                # kept alive across streams instead).
                index = index.pin_memory()
            indices.append(index)
        return cls([pool for pool, _ in pools_and_slots], indices, metadata, row)

    @property
    def filled(self) -> list[tuple[KVPool, torch.Tensor]]:
        """The pools with at least one slot: an empty pool sends nothing."""
        return [(pool, index) for pool, index in zip(self.pools, self.indices) if len(index)]


# Each segment of the wire buffer starts on this boundary, so every field can be viewed in its
# own dtype (int64 needs 8-byte alignment) without a copy. MetadataBuffers rows are a multiple of
# it long.
_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def kv_shape(pool: KVPool, num_tokens: int) -> tuple[int, ...]:
    """One pool's KV on the wire: [n, num_layers, 2 (K, V), num_kv_heads, head_dim]."""
    return (num_tokens, pool.num_layers, 2, pool.num_kv_heads, pool.head_dim)


class WireLayout:
    """Where each piece of one transfer sits in its single byte buffer: every pool's KV, then the
    metadata row (`MetadataBuffers.row_bytes`, room last). One buffer means one send and one
    receive per transfer; one row segment means one copy of the row each way."""

    def __init__(self, source: KVSource) -> None:
        self.kv: list[tuple[int, tuple[int, ...], torch.dtype]] = []
        offset = 0
        for pool, index in source.filled:
            shape = kv_shape(pool, len(index))
            self.kv.append((offset, shape, pool.dtype))
            offset += _aligned(math.prod(shape) * pool.dtype.itemsize)
        self.row_offset = offset
        self.row_nbytes = source.metadata.row_nbytes
        self.nbytes = offset + _aligned(self.row_nbytes)

    def kv_view(self, wire: torch.Tensor, i: int) -> torch.Tensor:
        offset, shape, dtype = self.kv[i]
        size = math.prod(shape) * dtype.itemsize
        return wire[offset : offset + size].view(dtype).view(shape)

    def row_view(self, wire: torch.Tensor) -> torch.Tensor:
        return wire[self.row_offset : self.row_offset + self.row_nbytes]


def _index(pool: KVPool, slots: list[int] | torch.Tensor) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor):
        slots = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    return slots.to(pool.device, non_blocking=True)


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _as_words(kv: torch.Tensor) -> torch.Tensor:
    """`kv` ([slots, ...], contiguous) as [slots, words]: the same bytes, in the widest integer
    type that tiles one slot's row. An indexing kernel moves one element per thread step, so
    int64 words move a bf16 pool's rows in a quarter of the elements (fp32: half)."""
    slot_numel = math.prod(kv.shape[1:])
    slot_nbytes = slot_numel * kv.element_size()
    word = next(t for t in _WORDS if slot_nbytes % t.itemsize == 0)
    return kv.view(kv.shape[0], slot_numel).view(word)


def _check_kv(pool: KVPool, kv: torch.Tensor, num_tokens: int) -> None:
    # Moved as raw words, a tensor of another dtype or shape would be reinterpreted silently.
    want = kv_shape(pool, num_tokens)
    if kv.dtype != pool.dtype or tuple(kv.shape) != want:
        raise ValueError(
            f"KV {tuple(kv.shape)} {kv.dtype} does not match the pool's {want} {pool.dtype}"
        )


def gather_kv(
    pool: KVPool, slots: list[int] | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every layer's K and V at `slots` (see `kv_shape`), into `out` when given."""
    index = _index(pool, slots)
    if out is None:
        out = torch.empty(kv_shape(pool, len(index)), dtype=pool.dtype, device=pool.device)
    _check_kv(pool, out, len(index))
    torch.index_select(_as_words(pool.kv_buffer), 0, index, out=_as_words(out))
    return out


def scatter_kv(pool: KVPool, slots: list[int] | torch.Tensor, kv: torch.Tensor) -> None:
    index = _index(pool, slots)
    _check_kv(pool, kv, len(index))
    _as_words(pool.kv_buffer).index_copy_(0, index, _as_words(kv.contiguous()))
