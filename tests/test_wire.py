"""metadata.wire: the one-op gather and scatter of a request's KV, which move each slot's row as
integer words (same bytes, fewer elements), and the single wire buffer of a transfer."""

from __future__ import annotations

import pytest
import torch

from engine.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.wire import KVSource, WireLayout, _as_words, gather_kv, kv_shape, scatter_kv

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


def test_wire_is_each_pools_kv_then_the_row_as_one_segment() -> None:
    pools = [
        KVPool(CAPACITY, 3, 1, 3, torch.bfloat16, "cpu"),
        KVPool(CAPACITY, 1, 1, 4, torch.float32, "cpu"),
    ]
    metadata = MetadataBuffers(2, 6, 2, 1, torch.bfloat16, "cpu")
    source = KVSource.build([(pools[0], [3, 4, 5]), (pools[1], [9])], metadata, 1)
    layout = WireLayout(source)
    kv_bytes = [3 * 2 * 3 * 3 * 2, 1 * 2 * 1 * 4 * 4]  # 108 (aligned to 112), 32
    assert [offset for offset, _, _ in layout.kv] == [0, 112]
    assert layout.row_offset == 112 + kv_bytes[1] and layout.row_nbytes == metadata.row_nbytes
    assert layout.nbytes == layout.row_offset + metadata.row_nbytes
    wire = torch.zeros(layout.nbytes, dtype=torch.uint8)
    metadata.write_row(
        1, room=8, output_id=1, output_logprob=0.0, hidden_state=torch.ones(6), cached_tokens=2
    )
    layout.row_view(wire).copy_(metadata.row_bytes(1))
    assert int(wire[layout.row_offset :].view(torch.int64)[-2]) == 8  # room, before padding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_index_for_a_cuda_pool_is_pinned() -> None:
    # A pageable index's copy to the GPU would wait on the host for the worker's stream.
    pool = KVPool(CAPACITY, 1, 1, 8, torch.bfloat16, "cuda")
    metadata = MetadataBuffers(1, 4, 0, 1, torch.bfloat16, "cuda")
    source = KVSource.build([(pool, [1, 2, 3])], metadata, 0)
    assert source.indices[0].device.type == "cpu" and source.indices[0].is_pinned()
