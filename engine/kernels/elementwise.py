"""Triton kernels for the decoder's elementwise work, one launch each where plain torch takes
four to eight: RMSNorm (optionally fused with the residual add before it), SiLU-and-multiply,
and rotary embedding fused with the write of K and V into the paged cache.

Each rounds where the torch code in engine/models rounds (to the model dtype after the add,
after the normalisation, after the activation, after each product of the rotation), so the
results agree with the torch path's to the model dtype's rounding (tests/test_triton_attention.py
bounds the difference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_sum,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / size + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` (+ `residual` when given) over its last dimension; returns (normed, the
    sum that was normalised), the sum being `x` itself without a residual. `out`: where the
    normed rows go ([T, size], its rows may be strided: a column slice of a wider tensor)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if out is None:
        out = torch.empty_like(x2)
    else:
        assert out.shape == x2.shape and out.stride(1) == 1
    if residual is None:
        summed, res2 = x2, x2
    else:
        res2 = residual.reshape(-1, shape[-1])
        summed = torch.empty_like(x2)
    rows, size = x2.shape
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            summed,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            summed.stride(0),
            size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(size),
            num_warps=4 if size <= 4096 else 8,
        )
    return out.view(shape) if out.is_contiguous() else out, summed.view(shape)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    out = (silu * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate, then up) -> silu(gate) * up, [T, I]."""
    rows, double = gate_up.shape
    size = double // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block
        )
    return out


@triton.jit
def _rotate_half(x_ptr, cos_ptr, sin_ptr, cols, mask, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """x * cos + rotate_half(x) * sin, each product rounded to DTYPE as torch rounds it."""
    x1 = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    first = (x1 * c1).to(DTYPE).to(tl.float32) + (-x2 * s1).to(DTYPE).to(tl.float32)
    second = (x2 * c2).to(DTYPE).to(tl.float32) + (x1 * s2).to(DTYPE).to(tl.float32)
    return first.to(DTYPE), second.to(DTYPE)


@triton.jit
def _rope_and_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_slot,
    stride_v_cache_head,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DTYPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < HALF
    cos = cos_ptr + token * stride_cos
    sin = sin_ptr + token * stride_cos
    if head < NUM_HEADS:
        first, second = _rotate_half(
            q_ptr + token * stride_q_token + head * stride_q_head, cos, sin, cols, mask, HALF, DTYPE
        )
        out = q_out_ptr + token * stride_q_out_token + head * stride_q_out_head
        tl.store(out + cols, first, mask=mask)
        tl.store(out + HALF + cols, second, mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slots_ptr + token).to(tl.int64)
        first, second = _rotate_half(
            k_ptr + token * stride_k_token + kv_head * stride_k_head,
            cos,
            sin,
            cols,
            mask,
            HALF,
            DTYPE,
        )
        k_out = k_cache_ptr + slot * stride_k_cache_slot + kv_head * stride_k_cache_head
        tl.store(k_out + cols, first, mask=mask)
        tl.store(k_out + HALF + cols, second, mask=mask)
        v_in = v_ptr + token * stride_v_token + kv_head * stride_v_head
        v_out = v_cache_ptr + slot * stride_v_cache_slot + kv_head * stride_v_cache_head
        tl.store(v_out + cols, tl.load(v_in + cols, mask=mask), mask=mask)
        tl.store(v_out + HALF + cols, tl.load(v_in + HALF + cols, mask=mask), mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] by cos/sin ([T, 1, D] or [T, D]), write k and v
    [T, Hkv, D] into the caches ([slots, Hkv, D] views) at `slots` [T]; returns rotated q."""
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads, dim), dtype=q.dtype, device=q.device)
    cos, sin = cos.reshape(num_tokens, dim), sin.reshape(num_tokens, dim)
    assert cos.stride() == sin.stride() and cos.stride(1) == 1 and q.stride(2) == 1
    if num_tokens:
        _rope_and_store_kernel[(num_tokens, num_heads + num_kv_heads)](
            q,
            k,
            v,
            cos,
            sin,
            slots,
            q_out,
            k_cache,
            v_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            q_out.stride(0),
            q_out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            NUM_HEADS=num_heads,
            HALF=dim // 2,
            BLOCK_HALF=triton.next_power_of_2(dim // 2),
            DTYPE=_TL_DTYPES[q.dtype],
            num_warps=1,
        )
    return q_out
