"""The Triton kernels against the torch reference they replace: paged attention for decode,
extends, speculative verify spans and alternative chains on scattered slots (against the torch
backend and SDPA), split-key decode, and the fused RMSNorm, SiLU-and-multiply and rotary +
KV write. GPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_backend import (
    HEAD_DIM,
    _assign_rows,
    _batch,
    _new_tokens,
    _pools,
    _reference_extend,
)

from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import triton_runs_on

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton"),
]

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}

CASES = {
    # name: (seq_lens, extend_lens)
    "decode": ([1, 17, 5, 40, 33], [1, 1, 1, 1, 1]),
    "prompts": ([9, 40, 1], [9, 40, 1]),
    "chunk after a prefix": ([30, 50], [12, 20]),
    "verify k=3": ([8, 20, 33, 4], [4, 4, 4, 4]),
    "mixed": ([4, 25, 60, 2, 13], [4, 1, 7, 2, 13]),
}


def _backends(num_heads: int, num_kv_heads: int):
    from engine.attention.triton_backend import TritonAttentionBackend

    return (
        TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM),
        TritonAttentionBackend(num_heads, num_kv_heads, HEAD_DIM),
    )


def _to(kv_pool, dtype):
    kv_pool.kv_buffer = kv_pool.kv_buffer.to(dtype)
    kv_pool.dtype = dtype
    layers = range(kv_pool.num_layers)
    kv_pool.k_buffers = [kv_pool.kv_buffer[:, layer, 0] for layer in layers]
    kv_pool.v_buffers = [kv_pool.kv_buffer[:, layer, 1] for layer in layers]
    return kv_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_torch_backend_and_sdpa(case, num_heads, num_kv_heads, dtype) -> None:
    seq_lens, extend_lens = CASES[case]
    kv_pool, req_pool = _pools(num_kv_heads, seed=num_heads, device="cuda")
    kv_pool = _to(kv_pool, dtype)
    rows, slots = _assign_rows(req_pool, seq_lens, seed=len(case))
    q, k, v = _new_tokens(sum(extend_lens), num_heads, num_kv_heads, seed=3, device="cuda")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    outs = []
    for backend in _backends(num_heads, num_kv_heads):
        batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
        batch.attn_metadata = backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 1, batch).float())
    reference = _reference_extend(
        q.float(), _to(kv_pool, torch.float32), 1, slots, extend_lens, HEAD_DIM**-0.5
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(outs[1], reference, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_alternative_chain_rows_read_the_shared_prefix() -> None:
    """A verify batch where a second row holds only a copy of the first row's prefix slots
    (an alternative chain) attends over that prefix plus its own tokens."""
    num_heads, num_kv_heads = 6, 2
    kv_pool, req_pool = _pools(num_kv_heads, seed=7, device="cuda")
    rows, slots = _assign_rows(req_pool, [20], seed=1)
    fork = req_pool.allocate_row()
    req_pool.copy_prefixes([(rows[0], fork)], 16)
    own = [250, 251, 252]
    req_pool.write(fork, 16, own)
    fork_slots = slots[0][:16] + own
    seq_lens, extend_lens = [20, 19], [4, 3]
    q, k, v = _new_tokens(7, num_heads, num_kv_heads, seed=5, device="cuda")
    torch_backend, triton_backend = _backends(num_heads, num_kv_heads)
    outs = []
    for backend in (torch_backend, triton_backend):
        batch = _batch(
            kv_pool, req_pool, rows + [fork], [slots[0], fork_slots], seq_lens, extend_lens
        )
        batch.attn_metadata = backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 0, batch))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_key_decode_equals_one_pass(num_splits: int) -> None:
    from engine.kernels.attention import paged_attention

    num_heads, num_kv_heads = 8, 2
    kv_pool, req_pool = _pools(num_kv_heads, seed=2, device="cuda")
    seq_lens = [64, 3, 41]
    rows, _ = _assign_rows(req_pool, seq_lens, seed=4)
    q = torch.randn(3, num_heads, HEAD_DIM, device="cuda")
    device_rows = torch.tensor(rows, device="cuda")
    lens = torch.tensor(seq_lens, device="cuda")
    starts, ones = torch.arange(3, device="cuda"), torch.ones(3, dtype=torch.int64, device="cuda")
    args = (
        kv_pool.k_buffers[2],
        kv_pool.v_buffers[2],
        req_pool.req_to_token,
        device_rows,
        lens,
        starts,
        ones,
        1,
        0.25,
    )
    one_pass = paged_attention(q, *args, num_splits=1)
    split = paged_attention(q, *args, num_splits=num_splits)
    torch.testing.assert_close(split, one_pass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_and_attend_writes_the_same_kv_as_the_reference(dtype) -> None:
    """The fused rotary + KV write leaves the cache as apply_rotary + KVPool.write does, and
    attends to the same result."""
    num_heads, num_kv_heads = 9, 3
    seq_lens, extend_lens = [12, 30], [5, 1]
    outs, caches = [], []
    for backend in _backends(num_heads, num_kv_heads):
        kv_pool, req_pool = _pools(num_kv_heads, seed=11, device="cuda")
        kv_pool = _to(kv_pool, dtype)
        rows, slots = _assign_rows(req_pool, seq_lens, seed=2)
        q, k, v = _new_tokens(6, num_heads, num_kv_heads, seed=8, device="cuda")
        angles = torch.rand(6, 1, HEAD_DIM, generator=torch.Generator().manual_seed(0)) * 6.28
        angles = angles.cuda()
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
        batch.attn_metadata = backend.prepare(batch)
        outs.append(
            backend.rotate_and_attend(q.to(dtype), k.to(dtype), v.to(dtype), cos, sin, 1, batch)
        )
        caches.append(kv_pool.kv_buffer[:, 1].clone())
    tol = TOLERANCE[dtype]
    # Where a rotated value is the small difference of two products, one product rounded the
    # other way moves it by a unit of the products' size, not of its own: an absolute bound.
    torch.testing.assert_close(caches[1][1:].float(), caches[0][1:].float(), atol=tol, rtol=0)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual: bool) -> None:
    from engine.kernels.elementwise import rms_norm

    x = torch.randn(37, 576, device="cuda").to(dtype)
    residual = torch.randn(37, 576, device="cuda").to(dtype)
    weight = torch.rand(576, device="cuda").to(dtype) + 0.5
    summed = (residual + x) if with_residual else x
    f = summed.float()
    expected = weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out, got_sum = rms_norm(x, weight, 1e-5, residual if with_residual else None)
    torch.testing.assert_close(got_sum, summed, atol=0, rtol=0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype) -> None:
    from engine.kernels.elementwise import silu_and_mul

    gate_up = (3 * torch.randn(19, 2 * 1536, device="cuda")).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_and_mul(gate_up).float(), expected.float(), atol=tol, rtol=tol)


def test_modules_keep_autograd_where_gradients_are_on() -> None:
    """The draft trainer runs the same modules with gradients: there they take the torch path,
    which autograd can differentiate; inference takes the kernels."""
    from engine.kernels import triton_usable
    from engine.models.llama import RMSNorm

    norm = RMSNorm(64, 1e-5).cuda()
    x = torch.randn(3, 64, device="cuda", requires_grad=True)
    out, summed = norm.add_and_norm(x, torch.randn(3, 64, device="cuda"))
    (norm(x).sum() + out.sum() + summed.sum()).backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.inference_mode():
        assert triton_usable(x.detach())
        fused = norm(x.detach())
    torch.testing.assert_close(fused, norm(x).detach(), atol=1e-5, rtol=1e-5)
