"""The batch builders of engine.executor.forward_batch: `device_batch` over tensors already on the
device (a CUDA graph's static buffers, the fixed-shape draft extend's), and the in-place token
writes a batch takes after it was built (a draft depth's patched tokens, a verify's next drafts)."""

from __future__ import annotations

import torch

from engine.attention import create_attention_backend
from engine.executor.forward_batch import Span, device_batch, extend_batch
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool


def _pools() -> tuple[KVPool, ReqToTokenPool]:
    return KVPool(32, 1, 1, 4, torch.float32, "cpu"), ReqToTokenPool(4, 16, "cpu")


def test_a_device_batch_holds_the_buffers_it_is_given_without_a_copy() -> None:
    pools = _pools()
    buffer = torch.arange(40, dtype=torch.int64).view(4, 10)
    ids, positions, slots, rows = buffer[0, :6], buffer[1, :6], buffer[2, :6], buffer[3, :2]
    batch = device_batch(ids, positions, slots, rows, [5, 4], [3, 3], pools)
    assert batch.input_ids.data_ptr() == buffer[0].data_ptr()
    assert batch.out_cache_loc.data_ptr() == buffer[2].data_ptr()
    assert batch.req_pool_indices.data_ptr() == buffer[3].data_ptr()
    assert (batch.kv_pool, batch.req_to_token_pool) == pools
    assert batch.prefix_lens == [2, 1] and batch.num_tokens == 6
    assert batch.attn_metadata is None and batch.graph is None and batch.tree_bits is None
    # Writes through the batch land in the buffer a graph would read.
    batch.set_tokens(torch.tensor([1, 4]), torch.tensor([-1, -2]))
    assert buffer[0, :6].tolist() == [0, -1, 2, 3, -2, 5]


def test_set_tokens_and_set_span_tails_write_only_the_tokens_named() -> None:
    kv_pool, req_pool = _pools()
    backend = create_attention_backend("torch", 2, 1, 4)
    spans = [
        Span(row, 0, [10 * row + j for j in range(3)], list(range(1 + 3 * row, 4 + 3 * row)))
        for row in range(3)
    ]
    for span in spans:
        req_pool.write(span.row, 0, span.slots)
    batch = extend_batch(spans, kv_pool, req_pool, backend, torch.device("cpu"))
    assert batch.input_ids.tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    batch.set_span_tails(torch.tensor([[-1, -2], [-3, -4], [-5, -6]]))
    assert batch.input_ids.tolist() == [0, -1, -2, 10, -3, -4, 20, -5, -6]
    batch.set_tokens(torch.tensor([3, 8]), torch.tensor([7, 9]))
    assert batch.input_ids.tolist() == [0, -1, -2, 7, -3, -4, 20, -5, 9]
    # The other tensors are the batch's as built.
    assert batch.positions.tolist() == [0, 1, 2] * 3
    assert batch.out_cache_loc.tolist() == list(range(1, 10))
