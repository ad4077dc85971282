"""The bytes of one transfer: which buffers it reads or fills (`KVSource`), the messages that
carry them (one per filled pool, then the metadata row), and the one-op gather and scatter of a
request's KV for slots that are not one contiguous run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers


def kv_shape(pool: KVPool, num_tokens: int) -> tuple[int, ...]:
    """One pool's KV on the wire: [n, num_layers, 2 (K, V), num_kv_heads, head_dim]."""
    return (num_tokens, pool.num_layers, 2, pool.num_kv_heads, pool.head_dim)


def kv_nbytes(pool: KVPool, num_tokens: int) -> int:
    return math.prod(kv_shape(pool, num_tokens)) * pool.dtype.itemsize


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat, without a copy. Messages travel as bytes, so that both
    sides post the same type and count whatever each side's buffer is (a pool slice or a
    staging tensor) and whatever the KV dtype (NCCL has no type for some of them)."""
    return tensor.view(-1).view(torch.uint8)


def _contiguous_run(slots: np.ndarray) -> int | None:
    """The first slot when `slots` ascend by one from it, else None."""
    first, n = int(slots[0]), len(slots)
    if int(slots[-1]) - first != n - 1:  # O(1), and enough to rule out most scattered lists
        return None
    if n > 2 and not (np.diff(slots) == 1).all():
        return None
    return first


@dataclass(frozen=True)
class PoolSlots:
    """One pool of a transfer with at least one slot: one message on the wire, exactly
    `kv_shape(pool, num_tokens)` of KV, whichever way each side reads or fills it.

    When the slots are one ascending contiguous run (`start`, as a fresh or lightly fragmented
    allocator hands them out) the message is a slice of the pool itself (`direct`): nothing is
    gathered, scattered or staged. Otherwise `index` holds them for a gather into (or a scatter
    from) a staging tensor. Each side decides for its own slots: the other side never knows."""

    pool: KVPool
    num_tokens: int
    start: int | None
    index: torch.Tensor | None  # CPU int64; pinned for a CUDA pool
    direct: torch.Tensor | None  # the run's bytes in the pool

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.pool, self.num_tokens)

    def staging(self) -> torch.Tensor:
        """A fresh tensor for this pool's KV, on the current stream."""
        pool = self.pool
        return torch.empty(kv_shape(pool, self.num_tokens), dtype=pool.dtype, device=pool.device)


@dataclass(frozen=True)
class KVSource:
    """The buffers of one transfer: what the sender reads, or what the receiver fills.

    `pools_and_slots`: the target pool first, then one per draft depth, each with the slots of
    the request's tokens in that pool; `metadata` and `row`: the request's metadata row.
    `build` validates them and prepares every message once, on the caller's side, so that the
    worker only posts: a contiguous run becomes a view of the pool, other slot lists an index
    tensor (numpy parses a Python list several times faster than torch.tensor does)."""

    filled: tuple[PoolSlots, ...]  # the pools with at least one slot: an empty one sends nothing
    metadata: MetadataBuffers
    row: int
    row_bytes: torch.Tensor  # MetadataBuffers.row_bytes(row): the last message
    nbytes: int  # every message's bytes

    @property
    def all_direct(self) -> bool:
        return all(piece.direct is not None for piece in self.filled)

    @classmethod
    def build(
        cls,
        pools_and_slots: list[tuple[KVPool, list[int]]],
        metadata: MetadataBuffers,
        row: int,
        skip: int = 0,
    ) -> KVSource:
        """`skip`: leave out the first pools (posted already, `KVSender.begin`): `filled` and
        `nbytes` then hold the rest of the transfer. No pool at all is a parallel sample's
        transfer that does not draft: its row alone (its prompt's KV came with another)."""
        if not 0 <= row < metadata.num_rows:
            raise ValueError(f"metadata row {row} out of range [0, {metadata.num_rows})")
        filled = pool_pieces(pools_and_slots[skip:])
        row_bytes = metadata.row_bytes(row)
        nbytes = sum(piece.nbytes for piece in filled) + metadata.row_nbytes
        return cls(filled, metadata, row, row_bytes, nbytes)


@dataclass(frozen=True)
class PoolMessages:
    """The messages of a transfer's leading pools, built ahead of posting them
    (`KVSender.begin`): turning thousands of slots into messages costs more than posting."""

    num_pools: int  # pools given, with or without slots
    pieces: tuple[PoolSlots, ...]

    @classmethod
    def build(cls, pools_and_slots: list[tuple[KVPool, list[int]]]) -> PoolMessages:
        return cls(len(pools_and_slots), pool_pieces(pools_and_slots))

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)


def pool_pieces(pools_and_slots: list[tuple[KVPool, list[int]]]) -> tuple[PoolSlots, ...]:
    """The messages of these pools (see `KVSource`): one per pool with at least one slot."""
    filled = []
    for depth, (pool, slots) in enumerate(pools_and_slots):
        array = np.asarray(slots, dtype=np.int64)
        # Slot 0 is the padding slot: it never holds a request's KV.
        in_range = array.size == 0 or 1 <= array.min() <= array.max() <= pool.capacity
        if array.ndim != 1 or not in_range:
            raise ValueError(f"pool {depth}: slots must lie in [1, {pool.capacity}]")
        n = array.size
        if n == 0:
            continue
        start = _contiguous_run(array)
        if start is not None:
            run = as_bytes(pool.kv_buffer[start : start + n])
            if run.numel() != kv_nbytes(pool, n):
                # A message of another size would take the place of the peer's next one.
                raise ValueError(
                    f"pool {depth}: kv_buffer {tuple(pool.kv_buffer.shape)} does not hold "
                    f"slots [{start}, {start + n}) of {kv_shape(pool, 1)[1:]} {pool.dtype}"
                )
            filled.append(PoolSlots(pool, n, start, None, run))
            continue
        index = torch.from_numpy(array)
        if pool.device.type == "cuda":
            # Pinned, so that the copy of the index to the GPU is asynchronous: a copy from
            # pageable memory first waits on the host for the stream, that is for the caller's
            # KV and all queued before it.
            index = index.pin_memory()
        filled.append(PoolSlots(pool, n, None, index, None))
    return tuple(filled)


def transfer_nbytes(pools_and_tokens: list[tuple[KVPool, int]], row_nbytes: int) -> int:
    """What a transfer of these pools (each with its number of tokens) and a row of
    `row_nbytes` puts on the wire."""
    return sum(kv_nbytes(pool, n) for pool, n in pools_and_tokens if n) + row_nbytes


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
