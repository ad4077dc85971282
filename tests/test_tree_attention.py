"""Token-tree attention for speculative verify: a span of the newest token and a draft tree's
nodes attends to the cached prefix and, among its own tokens, only to each node's ancestors and
itself; its rotary positions are the nodes' levels. The torch backend against plain softmax
attention over the cache, on batches mixing trees, chains and decode (batched and per-request
paths, scattered slots, trees with and without a prefix); the Triton kernel against the torch
backend on the same batches (GPU)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from devices import DEVICES
from test_attention_backend import CAPACITY, HEAD_DIM, NUM_LAYERS, _assign_rows, _new_tokens

from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.torch_metadata import BatchedGroups, PerRequestMetadata
from engine.executor.forward_batch import (
    TREE_MAX_TOKENS,
    ForwardBatch,
    Span,
    extend_batch,
    tree_bits,
)
from engine.kernels import triton_runs_on
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool

MAX_CONTEXT = 128
LAYER = 1


@dataclass
class Request:
    """One request of a test batch: `prefix` cached tokens, then `new` tokens that form a tree
    (`parents[j]`: span index of token j's parent, -1 for the root) or a chain (parents None)."""

    prefix: int
    new: int
    parents: list[int] | None = None

    def ancestors(self, j: int) -> list[int]:
        """Span indices token j may see: itself and its ancestors (a chain: every earlier one)."""
        if self.parents is None:
            return list(range(j + 1))
        seen = []
        while j >= 0:
            seen.append(j)
            j = self.parents[j]
        return sorted(seen)

    def levels(self) -> list[int]:
        assert self.parents is not None
        levels: list[int] = []
        for parent in self.parents:
            levels.append(0 if parent < 0 else levels[parent] + 1)
        return levels


def tree(prefix: int, nodes: int, seed: int) -> Request:
    """The newest token and a random tree of `nodes` drafts below it, parents before children."""
    rng = random.Random(seed)
    return Request(prefix, nodes + 1, [-1] + [rng.randrange(i) for i in range(1, nodes + 1)])


def chain(prefix: int, new: int) -> Request:
    return Request(prefix, new)


def _pools(
    num_kv_heads: int, seed: int, device: str, dtype: torch.dtype = torch.float32
) -> tuple[KVPool, ReqToTokenPool]:
    """As test_attention_backend's, with rows long enough for a prompt and a tree."""
    gen = torch.Generator().manual_seed(seed)
    kv_pool = KVPool(CAPACITY, NUM_LAYERS, num_kv_heads, HEAD_DIM, dtype, device)
    kv_pool.kv_buffer.copy_(torch.randn(kv_pool.kv_buffer.shape, generator=gen))
    # Large values in the padding slot: a padded position that leaked into the softmax would
    # dominate it.
    kv_pool.kv_buffer[0] = 1e4 * torch.randn(kv_pool.kv_buffer[0].shape, generator=gen)
    return kv_pool, ReqToTokenPool(8, MAX_CONTEXT, device)


def _spans(requests: list[Request], req_pool: ReqToTokenPool, seed: int) -> list[Span]:
    """Each request's span over a row of scattered slots (which `_assign_rows` writes)."""
    rows, slots = _assign_rows(req_pool, [r.prefix + r.new for r in requests], seed)
    spans = []
    for request, row, row_slots in zip(requests, rows, slots):
        span = Span(row, request.prefix, [0] * request.new, row_slots[request.prefix :])
        if request.parents is not None:
            span.positions = [request.prefix + level for level in request.levels()]
            span.visible = [sum(1 << i for i in request.ancestors(j)) for j in range(request.new)]
        spans.append(span)
    return spans


def _reference(
    q: torch.Tensor,
    kv_pool: KVPool,
    req_pool: ReqToTokenPool,
    requests: list[Request],
    spans: list[Span],
    scale: float,
) -> torch.Tensor:
    """Softmax attention in float32 of every new token over the cache positions it may see,
    listed one by one: [T, H, D]."""
    outputs = []
    token = 0
    for request, span in zip(requests, spans):
        for j in range(request.new):
            visible = list(range(request.prefix))
            visible += [request.prefix + i for i in request.ancestors(j)]
            slots = req_pool.req_to_token[span.row, visible]
            kv = kv_pool.kv_buffer[slots, LAYER].float()  # [L, 2, Hkv, D]
            query = q[token].float()  # [H, D]
            group = query.shape[0] // kv.shape[2]
            keys = kv[:, 0].repeat_interleave(group, dim=1)  # [L, H, D]
            values = kv[:, 1].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,lhd->hl", query, keys) * scale, dim=-1)
            outputs.append(torch.einsum("hl,lhd->hd", weights, values))
            token += 1
    return torch.stack(outputs)


def _run(
    backend,
    requests: list[Request],
    num_heads: int,
    num_kv_heads: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, ForwardBatch, list[Span], torch.Tensor]:
    """A forward of one layer over these requests: (output, batch, spans, q)."""
    kv_pool, req_pool = _pools(num_kv_heads, seed, device, dtype)
    spans = _spans(requests, req_pool, seed=seed + 1)
    batch = extend_batch(spans, kv_pool, req_pool, backend, torch.device(device))
    tokens = sum(r.new for r in requests)
    q, k, v = (x.to(dtype) for x in _new_tokens(tokens, num_heads, num_kv_heads, seed + 2, device))
    return backend.forward(q, k, v, LAYER, batch), batch, spans, q


# name: (requests, the torch backend's path on a CPU)
CASES = {
    # A tree of 10 drafts next to a chain verify and a decode token, all after prefixes.
    "mixed": ([tree(20, 10, seed=1), chain(13, 5), chain(30, 1)], BatchedGroups),
    # A wide tree (every node under the root) and a deep one (a chain as a tree).
    "wide and deep": (
        [Request(9, 8, [-1] + [0] * 7), Request(17, 6, [-1, 0, 1, 2, 3, 4]), chain(5, 1)],
        BatchedGroups,
    ),
    # Past SHORT_EXTEND_MAX_TOKENS: SDPA per request, with a prompt of more tokens than a tree
    # mask has bits (causal whatever its offsets).
    "long tree": ([tree(25, 30, seed=2), chain(0, 80), chain(40, 1)], PerRequestMetadata),
    # A tree without a cached prefix: alone (per request, SDPA otherwise causal), or batched.
    # Decode where one request's single token is a tree of its root alone.
    "single-token tree": ([tree(20, 0, seed=6), chain(30, 1), chain(3, 1)], BatchedGroups),
    "no prefix, alone": ([tree(0, 10, seed=3)], PerRequestMetadata),
    "no prefix, batched": ([tree(0, 12, seed=4), chain(7, 1)], BatchedGroups),
    "largest tree": ([tree(3, TREE_MAX_TOKENS - 1, seed=5), chain(0, 20)], PerRequestMetadata),
}


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3)])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_torch_backend_attends_to_ancestors_only(
    case: str, num_heads: int, num_kv_heads: int, device: str
) -> None:
    requests, path = CASES[case]
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    out, batch, spans, q = _run(backend, requests, num_heads, num_kv_heads, device)
    lone_on_gpu = len(requests) == 1 and device != "cpu"
    assert isinstance(batch.attn_metadata, BatchedGroups if lone_on_gpu else path)
    expected = _reference(q, batch.kv_pool, batch.req_to_token_pool, requests, spans, backend.scale)
    # GPU kernels sum in other orders than the reference's.
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_a_tree_attends_otherwise_than_its_chain() -> None:
    """The mask matters: the same tokens read causally give another output."""
    requests = [tree(20, 10, seed=1), chain(13, 5)]
    backend = TorchAttentionBackend(4, 2, HEAD_DIM)
    out, *_ = _run(backend, requests, 4, 2, "cpu")
    causal, *_ = _run(backend, [chain(20, 11), chain(13, 5)], 4, 2, "cpu")
    assert not torch.allclose(out[:11], causal[:11], atol=1e-3)
    torch.testing.assert_close(out[11:], causal[11:], rtol=1e-6, atol=1e-6)


def test_tree_batch_carries_positions_bits_and_slots() -> None:
    requests = [tree(20, 6, seed=7), chain(13, 3)]
    backend = TorchAttentionBackend(4, 2, HEAD_DIM)
    out, batch, spans, _ = _run(backend, requests, 4, 2, "cpu", seed=9)
    root_level_positions = [20 + level for level in requests[0].levels()]
    assert batch.positions.tolist() == root_level_positions + [13, 14, 15]
    bits = batch.tree_bits.tolist()
    assert bits[:7] == spans[0].visible and bits[7:] == [-1, -1, -1]
    assert batch.seq_lens == [27, 16] and batch.extend_lens == [7, 3]
    # Nodes keep consecutive cache positions: the new K and V went to the span's own slots.
    assert batch.out_cache_loc.tolist() == spans[0].slots + spans[1].slots
    k = _new_tokens(10, 4, 2, 11, "cpu")[1]
    torch.testing.assert_close(batch.kv_pool.kv_buffer[batch.out_cache_loc, LAYER, 0], k)


def test_visible_masks_are_kept_to_the_token_and_those_before_it() -> None:
    """A token's own bit is set, and bits of later tokens (hidden by causality) are dropped."""
    _, req_pool = _pools(2, seed=0, device="cpu")
    kv_pool = KVPool(CAPACITY, NUM_LAYERS, 2, HEAD_DIM, torch.float32, "cpu")
    (span,) = _spans([chain(4, 3)], req_pool, seed=1)
    span.visible = [0, 0b1000, -1]
    batch = extend_batch([span], kv_pool, req_pool, TorchAttentionBackend(4, 2, HEAD_DIM), "cpu")
    assert batch.tree_bits.tolist() == [0b1, 0b10, 0b111]
    span.visible = [1] * (TREE_MAX_TOKENS + 1)
    span.token_ids = span.slots = list(range(1, TREE_MAX_TOKENS + 2))
    with pytest.raises(AssertionError):
        extend_batch([span], kv_pool, req_pool, TorchAttentionBackend(4, 2, HEAD_DIM), "cpu")


def test_a_batch_without_trees_has_no_tree_bits() -> None:
    requests = [chain(20, 11), chain(13, 5), chain(0, 30)]
    backend = TorchAttentionBackend(4, 2, HEAD_DIM)
    _, batch, spans, _ = _run(backend, requests, 4, 2, "cpu")
    assert batch.tree_bits is None
    # Positions given without a mask: still no tree bits.
    spans[0].positions = [20] * 11
    batch = extend_batch(spans, batch.kv_pool, batch.req_to_token_pool, backend, "cpu")
    assert batch.tree_bits is None and batch.positions[:11].tolist() == [20] * 11


def needs_gpu(test):
    skip = pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
    return pytest.mark.gpu(skip(test))


TRITON_TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_torch_backend_on_trees(case, num_heads, num_kv_heads, dtype) -> None:
    from engine.attention.triton_backend import TritonAttentionBackend

    requests, _ = CASES[case]
    outs = []
    for backend in (
        TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM),
        TritonAttentionBackend(num_heads, num_kv_heads, HEAD_DIM),
    ):
        out, batch, spans, q = _run(backend, requests, num_heads, num_kv_heads, "cuda", dtype)
        outs.append(out.float())
    assert batch.attn_metadata.tree_bits is batch.tree_bits
    expected = _reference(
        q, batch.kv_pool, batch.req_to_token_pool, requests, spans, HEAD_DIM**-0.5
    )
    tol = TRITON_TOLERANCE[dtype]
    torch.testing.assert_close(outs[1], expected, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@needs_gpu
def test_only_graphs_of_trees_take_tree_spans() -> None:
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.executor.cuda_graph import CudaGraphs

    backend = TritonAttentionBackend(4, 2, HEAD_DIM)
    kv_pool, req_pool = _pools(2, seed=0, device="cuda")
    graphs = CudaGraphs("verify", lambda batch, hidden: (), backend, kv_pool, req_pool, [64], 16)
    spans = _spans([tree(10, 5, seed=1), chain(4, 3)], req_pool, seed=2)
    assert not graphs.fits(spans)
    spans[0].visible = None
    assert not graphs.fits(spans)  # positions alone
    spans[0].positions = None
    assert graphs.fits(spans)
    meta = backend.prepare_for_capture(*graphs.inputs[3:7, :4], 4)
    assert meta.tree_bits is None
    trees = CudaGraphs(
        "verify", lambda batch, hidden: (), backend, kv_pool, req_pool, [64], 16, trees=True
    )
    assert trees.fits(_spans([tree(10, 5, seed=1), chain(4, 3)], req_pool, seed=2))


def test_tree_graph_columns_carry_positions_and_masks_and_pad_causally() -> None:
    """A tree graph's static input: each span's rotary positions and masks, then padding
    tokens at position 0 with the causal mask (-1)."""
    from engine.executor.graph_inputs import padded_columns

    _, req_pool = _pools(2, seed=0, device="cpu")
    spans = _spans([tree(10, 5, seed=1), chain(4, 3)], req_pool, seed=2)
    columns = padded_columns(16, spans, req_pool.padding_row, trees=True)
    assert len(columns) == 9
    ids, positions, *_, bits = columns
    real = sum(len(span.token_ids) for span in spans)
    assert positions[:real] == spans[0].positions + list(range(4, 7))
    assert bits[:real] == tree_bits(spans)
    assert bits[real:] == [-1] * (16 - real) and positions[real:] == [0] * (16 - real)
    assert len(padded_columns(16, spans, req_pool.padding_row)) == 8
