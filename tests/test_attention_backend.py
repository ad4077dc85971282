"""The torch attention backend against torch's own scaled_dot_product_attention: decode and short
extends (its own grouped-query attention, batched) and long extends (SDPA per request), on ragged
batches, with and without grouped KV heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from devices import DEVICES

import engine.attention.torch_metadata as torch_metadata
from engine.attention.torch_backend import SHORT_EXTEND_MAX_TOKENS, TorchAttentionBackend
from engine.attention.torch_metadata import BatchedGroups, PerRequestMetadata
from engine.executor.forward_batch import ForwardBatch
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool

HEAD_DIM = 16
NUM_LAYERS = 3
CAPACITY = 256
MAX_CONTEXT = 64


def _pools(num_kv_heads: int, seed: int, device: str = "cpu") -> tuple[KVPool, ReqToTokenPool]:
    gen = torch.Generator().manual_seed(seed)
    kv_pool = KVPool(CAPACITY, NUM_LAYERS, num_kv_heads, HEAD_DIM, torch.float32, device)
    kv_pool.kv_buffer.copy_(torch.randn(kv_pool.kv_buffer.shape, generator=gen))
    # Large values in the padding slot: a padded position that leaked into the softmax would
    # dominate it.
    kv_pool.kv_buffer[0] = 1e4 * torch.randn(kv_pool.kv_buffer[0].shape, generator=gen)
    return kv_pool, ReqToTokenPool(8, MAX_CONTEXT, device)


def _assign_rows(
    req_pool: ReqToTokenPool, seq_lens: list[int], seed: int
) -> tuple[list[int], list[list[int]]]:
    """Each request gets a row of scattered, distinct slots (never the padding slot 0)."""
    order = (torch.randperm(CAPACITY, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    rows, slots = [], []
    for seq_len in seq_lens:
        row = req_pool.allocate_row()
        mine, order = order[:seq_len], order[seq_len:]
        req_pool.write(row, 0, mine)
        rows.append(row)
        slots.append(mine)
    return rows, slots


def _batch(
    kv_pool: KVPool,
    req_pool: ReqToTokenPool,
    rows: list[int],
    slots: list[list[int]],
    seq_lens: list[int],
    extend_lens: list[int],
) -> ForwardBatch:
    new_slots = [s for row_slots, n in zip(slots, extend_lens) for s in row_slots[-n:]]
    positions = [p for seq, n in zip(seq_lens, extend_lens) for p in range(seq - n, seq)]
    device = kv_pool.device
    return ForwardBatch(
        input_ids=torch.zeros(len(new_slots), dtype=torch.int64, device=device),
        positions=torch.tensor(positions, device=device),
        out_cache_loc=torch.tensor(new_slots, device=device),
        req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        kv_pool=kv_pool,
        req_to_token_pool=req_pool,
    )


def _reference(
    q: torch.Tensor, kv_pool: KVPool, layer: int, slots: list[int], scale: float
) -> torch.Tensor:
    """SDPA of the last len(q) tokens of one request over all of its cached tokens: [n, H, D]."""
    kv = kv_pool.kv_buffer[torch.tensor(slots, device=q.device), layer]  # [L, 2, Hkv, D]
    n, seq_len = q.shape[0], len(slots)
    causal = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
    causal = causal.to(q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        kv[:, 0].transpose(0, 1)[None],
        kv[:, 1].transpose(0, 1)[None],
        attn_mask=causal,
        scale=scale,
        enable_gqa=q.shape[1] != kv.shape[2],
    )
    return out[0].transpose(0, 1)


def _reference_extend(
    q: torch.Tensor,
    kv_pool: KVPool,
    layer: int,
    slots: list[list[int]],
    extend_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """`_reference` of every request of a batch, in the batch's flat token layout: [T, H, D]."""
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    return torch.cat(
        [
            _reference(q[start : start + new], kv_pool, layer, request_slots, scale)
            for start, new, request_slots in zip(starts, extend_lens, slots)
        ]
    )


def _new_tokens(
    tokens: int, num_heads: int, num_kv_heads: int, seed: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [T, H, D], k and v [T, Hkv, D] of the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=gen)
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3), (3, 1)])
@pytest.mark.parametrize("layer", [0, NUM_LAYERS - 1])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_matches_sdpa_on_a_ragged_batch(
    num_heads: int, num_kv_heads: int, layer: int, device: str
) -> None:
    kv_pool, req_pool = _pools(num_kv_heads, seed=num_heads, device=device)
    seq_lens = [1, 17, 5, 40, 33]
    rows, slots = _assign_rows(req_pool, seq_lens, seed=layer)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, [1] * len(seq_lens))
    assert batch.is_decode
    batch.attn_metadata = backend.prepare(batch)

    gen = torch.Generator().manual_seed(100 + layer)
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=gen).to(device)
    k = torch.randn(len(seq_lens), num_kv_heads, HEAD_DIM, generator=gen).to(device)
    v = torch.randn(len(seq_lens), num_kv_heads, HEAD_DIM, generator=gen).to(device)
    out = backend.forward(q, k, v, layer, batch)

    assert out.shape == q.shape
    # GPU kernels sum in other orders than the reference's.
    tol = 1e-5 if device == "cpu" else 1e-4
    for i, request_slots in enumerate(slots):
        # forward wrote the new token's K and V; the reference reads them back from the pool.
        expected = _reference(q[i : i + 1], kv_pool, layer, request_slots, backend.scale)
        torch.testing.assert_close(out[i : i + 1], expected, rtol=tol, atol=tol)


def test_decode_matches_the_padded_sdpa_it_replaces() -> None:
    """The former decode: one SDPA over the padded batch, additive mask, enable_gqa."""
    num_heads, num_kv_heads, layer = 9, 3, 1
    kv_pool, req_pool = _pools(num_kv_heads, seed=3)
    seq_lens = [29, 3, 64, 12]
    rows, slots = _assign_rows(req_pool, seq_lens, seed=4)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, [1] * len(seq_lens))
    batch.attn_metadata = backend.prepare(batch)
    ((_, _, meta),) = batch.attn_metadata.groups
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    k = kv_pool.kv_buffer[batch.out_cache_loc, layer, 0].clone()
    v = kv_pool.kv_buffer[batch.out_cache_loc, layer, 1].clone()
    out = backend.forward(q, k, v, layer, batch)

    kv = kv_pool.kv_buffer[:, layer][meta.slots]
    expected = F.scaled_dot_product_attention(
        q[:, :, None, :],
        kv[:, :, 0].transpose(1, 2),
        kv[:, :, 1].transpose(1, 2),
        attn_mask=meta.mask,
        scale=backend.scale,
        enable_gqa=True,
    )[:, :, 0, :]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3)])
def test_extend_matches_sdpa_with_and_without_a_cached_prefix(
    num_heads: int, num_kv_heads: int
) -> None:
    kv_pool, req_pool = _pools(num_kv_heads, seed=7)
    seq_lens = [9, 30, 1, 20]
    extend_lens = [9, 4, 1, 1]  # a fresh prompt, a chunk after a prefix, then single tokens
    rows, slots = _assign_rows(req_pool, seq_lens, seed=8)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
    assert not batch.is_decode
    batch.attn_metadata = backend.prepare(batch)

    q, k, v = _new_tokens(sum(extend_lens), num_heads, num_kv_heads, 9, "cpu")
    out = backend.forward(q, k, v, 2, batch)

    expected = _reference_extend(q, kv_pool, 2, slots, extend_lens, backend.scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_single_new_token_gets_the_same_output_from_decode_and_extend() -> None:
    num_heads, num_kv_heads, layer = 9, 3, 1
    kv_pool, req_pool = _pools(num_kv_heads, seed=11)
    seq_lens = [25, 14]
    rows, slots = _assign_rows(req_pool, seq_lens, seed=12)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(3, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen)

    # Request 0 extends by its one last token next to a request of two new tokens: extend path.
    extend = _batch(kv_pool, req_pool, rows, slots, seq_lens, [1, 2])
    extend.attn_metadata = backend.prepare(extend)
    by_extend = backend.forward(q, k, v, layer, extend)[:1]

    decode = _batch(kv_pool, req_pool, rows[:1], slots[:1], seq_lens[:1], [1])
    decode.attn_metadata = backend.prepare(decode)
    by_decode = backend.forward(q[:1], k[:1], v[:1], layer, decode)
    torch.testing.assert_close(by_decode, by_extend, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_in_bfloat16_stays_close_to_float32(device: str) -> None:
    num_heads, num_kv_heads, layer = 9, 3, 0
    kv_pool, req_pool = _pools(num_kv_heads, seed=21, device=device)
    seq_lens = [50, 7, 33]
    rows, slots = _assign_rows(req_pool, seq_lens, seed=22)
    q = torch.randn(3, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(23))
    q = q.to(device)
    last = torch.tensor([s[-1] for s in slots], device=device)
    k = kv_pool.kv_buffer[last, layer, 0].clone()
    v = kv_pool.kv_buffer[last, layer, 1].clone()
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)

    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool(CAPACITY, NUM_LAYERS, num_kv_heads, HEAD_DIM, dtype, device)
        pool.kv_buffer.copy_(kv_pool.kv_buffer)
        batch = _batch(pool, req_pool, rows, slots, seq_lens, [1] * 3)
        batch.attn_metadata = backend.prepare(batch)
        out = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), layer, batch)
        assert out.dtype == dtype
        outputs.append(out.float())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0.05, atol=0.05)


# Speculative batches: a fresh short prompt (no prefix), a span of exactly the threshold, a single
# token, a verify of the newest token and 3 drafts, and a longer verify, all after different
# prefixes, so that every request is padded to the longest span but one.
SHORT_SEQ_LENS = [5, 40, 33, 30, 64]
SHORT_EXTEND_LENS = [5, SHORT_EXTEND_MAX_TOKENS, 1, 4, 9]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (9, 3), (3, 1)])
@pytest.mark.parametrize("layer", [0, NUM_LAYERS - 1])
@pytest.mark.parametrize("device", DEVICES)
def test_short_extend_matches_sdpa_on_a_mixed_batch(
    num_heads: int, num_kv_heads: int, layer: int, device: str
) -> None:
    kv_pool, req_pool = _pools(num_kv_heads, seed=31 + num_heads, device=device)
    rows, slots = _assign_rows(req_pool, SHORT_SEQ_LENS, seed=32 + layer)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    batch = _batch(kv_pool, req_pool, rows, slots, SHORT_SEQ_LENS, SHORT_EXTEND_LENS)
    batch.attn_metadata = backend.prepare(batch)
    assert isinstance(batch.attn_metadata, BatchedGroups)

    q, k, v = _new_tokens(sum(SHORT_EXTEND_LENS), num_heads, num_kv_heads, 33, device)
    out = backend.forward(q, k, v, layer, batch)

    expected = _reference_extend(q, kv_pool, layer, slots, SHORT_EXTEND_LENS, backend.scale)
    # GPU kernels sum in other orders than the reference's.
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_short_extend_in_bfloat16_stays_close_to_float32(device: str) -> None:
    num_heads, num_kv_heads, layer = 9, 3, 1
    kv_pool, req_pool = _pools(num_kv_heads, seed=41, device=device)
    rows, slots = _assign_rows(req_pool, SHORT_SEQ_LENS, seed=42)
    q, k, v = _new_tokens(sum(SHORT_EXTEND_LENS), num_heads, num_kv_heads, 43, device)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)

    pool = KVPool(CAPACITY, NUM_LAYERS, num_kv_heads, HEAD_DIM, torch.bfloat16, device)
    pool.kv_buffer.copy_(kv_pool.kv_buffer)
    batch = _batch(pool, req_pool, rows, slots, SHORT_SEQ_LENS, SHORT_EXTEND_LENS)
    batch.attn_metadata = backend.prepare(batch)
    assert isinstance(batch.attn_metadata, BatchedGroups)
    dtype = torch.bfloat16
    out = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), layer, batch)
    assert out.dtype == dtype

    kv_pool.write(layer, batch.out_cache_loc, k, v)
    expected = _reference_extend(q, kv_pool, layer, slots, SHORT_EXTEND_LENS, backend.scale)
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    ("seq_lens", "extend_lens"),
    [
        # A span just over the threshold sends the whole batch, short spans too, per request.
        (
            [SHORT_EXTEND_MAX_TOKENS + 1, 40, 20],
            [SHORT_EXTEND_MAX_TOKENS + 1, SHORT_EXTEND_MAX_TOKENS + 1, 3],
        ),
        ([30], [4]),  # a lone request on a CPU has no calls to batch (on a GPU: batched)
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3)])
@pytest.mark.parametrize("device", DEVICES)
def test_long_spans_and_lone_requests_on_a_cpu_extend_per_request(
    seq_lens: list[int], extend_lens: list[int], num_heads: int, num_kv_heads: int, device: str
) -> None:
    kv_pool, req_pool = _pools(num_kv_heads, seed=51, device=device)
    rows, slots = _assign_rows(req_pool, seq_lens, seed=52)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
    batch.attn_metadata = backend.prepare(batch)
    lone_on_gpu = len(seq_lens) == 1 and device != "cpu"
    expected_path = BatchedGroups if lone_on_gpu else PerRequestMetadata
    assert isinstance(batch.attn_metadata, expected_path)

    q, k, v = _new_tokens(sum(extend_lens), num_heads, num_kv_heads, 53, device)
    out = backend.forward(q, k, v, 2, batch)

    expected = _reference_extend(q, kv_pool, 2, slots, extend_lens, backend.scale)
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("extend_lens", [[1] * 6, [1, 3, 2, 1, 4, 1]], ids=["decode", "extend"])
def test_a_large_batch_runs_in_groups_with_the_same_output(monkeypatch, extend_lens) -> None:
    """Past BATCHED_GROUP_BYTES the batched path attends group by group of requests: the
    output is the one-group output, however the requests fall into groups."""
    num_heads, num_kv_heads, layer = 9, 3, 1
    kv_pool, req_pool = _pools(num_kv_heads, seed=31)
    seq_lens = [12, 40, 7, 33, 25, 3]
    rows, slots = _assign_rows(req_pool, seq_lens, seed=32)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    q, k, v = _new_tokens(sum(extend_lens), num_heads, num_kv_heads, 33, "cpu")

    def run() -> tuple[torch.Tensor, int]:
        batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
        batch.attn_metadata = backend.prepare(batch)
        assert isinstance(batch.attn_metadata, BatchedGroups)
        return backend.forward(q, k, v, layer, batch), len(batch.attn_metadata.groups)

    whole, one = run()
    # Room for about two requests of the longest context per group.
    per_request = 40 * (2 * num_kv_heads * HEAD_DIM * 4 + num_heads * max(extend_lens) * 4)
    monkeypatch.setattr(torch_metadata, "BATCHED_GROUP_BYTES", 2 * per_request)
    grouped, several = run()
    assert one == 1 and several >= 3
    torch.testing.assert_close(grouped, whole, rtol=1e-6, atol=1e-6)
