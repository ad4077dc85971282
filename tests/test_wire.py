"""metadata.wire: the one-op gather and scatter of a request's KV, which move each slot's row as
integer words (same bytes, fewer elements), and the messages of a transfer: a pool whose slots
are one ascending contiguous run travels as a view of the pool, any other through an index."""

from __future__ import annotations

import pytest
import torch

from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.wire import (
    KVSource,
    _as_words,
    as_bytes,
    gather_kv,
    kv_shape,
    scatter_kv,
    transfer_nbytes,
)

CAPACITY = 40


def random_bits(pool: KVPool, seed: int) -> None:
    """Arbitrary bit patterns (NaNs, infinities, subnormals included): only bytes may move."""
    raw = pool.kv_buffer.view(torch.uint8).view(-1)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [8, 3])  # 3: a slot's row is 4-byte, not 8-byte, aligned
def test_gather_scatter_round_trip_byte_identical(dtype: torch.dtype, head_dim: int) -> None:
    source = KVPool(CAPACITY, 3, 1, head_dim, dtype, "cpu")
    target = KVPool(CAPACITY, 3, 1, head_dim, dtype, "cpu")
    random_bits(source, seed=1)
    sent, landed = [5, 2, 39, 17], [1, 40, 7, 20]
    kv = gather_kv(source, sent)
    assert kv.shape == kv_shape(source, 4) and kv.dtype == dtype
    want = source.kv_buffer[torch.tensor(sent)]  # torch's advanced indexing as the reference
    assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8))
    scatter_kv(target, landed, kv)
    assert torch.equal(target.kv_buffer[landed].view(torch.uint8), kv.view(torch.uint8))
    others = [s for s in range(CAPACITY + 1) if s not in landed]
    assert not target.kv_buffer[others].view(torch.uint8).any()


@pytest.mark.parametrize(
    ("dtype", "head_dim", "word"),
    [
        (torch.bfloat16, 8, torch.int64),
        (torch.float32, 3, torch.int64),
        (torch.bfloat16, 3, torch.int32),
        (torch.float16, 1, torch.int32),
    ],
)
def test_kv_moves_as_the_widest_word_that_tiles_a_slot(
    dtype: torch.dtype, head_dim: int, word: torch.dtype
) -> None:
    pool = KVPool(CAPACITY, 3, 1, head_dim, dtype, "cpu")
    words = _as_words(pool.kv_buffer)
    assert words.dtype == word and words.shape[0] == CAPACITY + 1
    assert words.data_ptr() == pool.kv_buffer.data_ptr()  # a view: nothing is copied
    assert words.shape[1] * word.itemsize == 2 * 3 * head_dim * dtype.itemsize


def test_scatter_refuses_kv_of_another_dtype_or_shape() -> None:
    pool = KVPool(CAPACITY, 2, 1, 4, torch.bfloat16, "cpu")
    same_bytes = torch.zeros(kv_shape(pool, 2)[:-1] + (2,), dtype=torch.float32)
    with pytest.raises(ValueError, match="does not match the pool's"):
        scatter_kv(pool, [1, 2], same_bytes)
    with pytest.raises(ValueError, match="does not match the pool's"):
        gather_kv(pool, [1, 2], out=torch.empty(kv_shape(pool, 3), dtype=torch.bfloat16))


def two_pools() -> list[KVPool]:
    return [
        KVPool(CAPACITY, 3, 1, 3, torch.bfloat16, "cpu"),  # 36 bytes a slot: not 16-aligned
        KVPool(CAPACITY, 1, 1, 4, torch.float32, "cpu"),
    ]


def test_contiguous_slots_travel_as_a_view_of_the_pool() -> None:
    pools = two_pools()
    random_bits(pools[0], seed=2)
    metadata = MetadataBuffers(2, 6, 2, 1, torch.bfloat16, "cpu")
    source = KVSource.build([(pools[0], [3, 4, 5]), (pools[1], [9])], metadata, 1)
    assert source.all_direct
    first, second = source.filled
    assert (first.start, first.num_tokens, first.index) == (3, 3, None)
    assert (second.start, second.num_tokens, second.index) == (9, 1, None)
    # The pool's own memory, not a copy: what a receive writes there lands in the slots.
    assert first.direct.data_ptr() == pools[0].kv_buffer[3].data_ptr()
    assert first.direct.dtype == torch.uint8 and first.direct.numel() == first.nbytes
    assert torch.equal(first.direct, as_bytes(gather_kv(pools[0], [3, 4, 5])))
    assert source.row_bytes.data_ptr() == metadata.row_bytes(1).data_ptr()


@pytest.mark.parametrize("slots", [[5, 4, 3], [3, 5, 6], [3, 3, 5], [7, 8, 10, 9], [2, 1]], ids=str)
def test_other_slot_lists_are_gathered_through_an_index(slots: list[int]) -> None:
    pools = two_pools()
    metadata = MetadataBuffers(1, 6, 0, 1, torch.bfloat16, "cpu")
    source = KVSource.build([(pools[0], slots), (pools[1], [1, 2])], metadata, 0)
    assert not source.all_direct
    scattered, contiguous = source.filled
    assert scattered.direct is None and scattered.start is None
    assert scattered.index.tolist() == slots
    assert contiguous.direct is not None  # each pool is decided on its own


def test_messages_are_each_pools_kv_then_the_row() -> None:
    pools = two_pools()
    metadata = MetadataBuffers(2, 6, 2, 1, torch.bfloat16, "cpu")
    source = KVSource.build([(pools[0], [3, 4, 5]), (pools[1], []), (pools[1], [9])], metadata, 1)
    kv_bytes = [3 * 3 * 2 * 1 * 3 * 2, 1 * 1 * 2 * 1 * 4 * 4]  # 108, 32
    assert [piece.nbytes for piece in source.filled] == kv_bytes  # the empty pool sends nothing
    assert source.nbytes == sum(kv_bytes) + metadata.row_nbytes
    assert source.nbytes == transfer_nbytes(
        [(pools[0], 3), (pools[1], 0), (pools[1], 1)], metadata.row_nbytes
    )
    staged = source.filled[0].staging()
    assert staged.shape == kv_shape(pools[0], 3) and staged.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_index_for_a_cuda_pool_is_pinned() -> None:
    # A pageable index's copy to the GPU would wait on the host for the worker's stream.
    pool = KVPool(CAPACITY, 1, 1, 8, torch.bfloat16, "cuda")
    metadata = MetadataBuffers(1, 4, 0, 1, torch.bfloat16, "cuda")
    source = KVSource.build([(pool, [3, 2, 1]), (pool, [1, 2, 3])], metadata, 0)
    gathered, direct = source.filled
    assert gathered.index.device.type == "cpu" and gathered.index.is_pinned()
    assert direct.index is None  # a contiguous run needs no index, so nothing is pinned
