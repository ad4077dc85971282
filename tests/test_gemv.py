"""The decoder's Linear: one row of a large weight on a GPU goes through the Triton
matrix-vector product, which agrees with a float32 product to the dtype's rounding, row tails
and both program shapes included; every other input, and every CPU input, is F.linear's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import triton_runs_on
from engine.models.linear import GEMV_MIN_ELEMENTS, Linear, gemv_applies

GPU = pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")

# (N, K): the small and the large program shape, rows that do not fill the last program, and
# each column tile (2048, 1024, 512).
SHAPES = [(4096, 4096), (28672, 4096), (4099, 4096), (16385, 1024), (32771, 512), (4097, 14336)]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_matches_a_float32_product(shape, dtype):
    from engine.kernels.gemv import gemv

    n, k = shape
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=generator) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=generator)
    with torch.inference_mode():
        assert gemv_applies(x, weight)
        out = gemv(x, weight)
    exact = (x.float() @ weight.float().T).to(dtype)
    assert out.shape == (1, n) and out.dtype == dtype
    # One rounding of the float32 sum, as cuBLAS's: the sums' order alone differs.
    torch.testing.assert_close(out, exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@GPU
def test_linear_takes_the_gemv_for_one_row_of_a_large_weight_only():
    layer = Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    one, two = (torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) for rows in (1, 2))
    with torch.inference_mode():
        assert gemv_applies(one, layer.weight) and not gemv_applies(two, layer.weight)
        assert not gemv_applies(one.view(2, 2048), layer.weight)  # K elements, not one row
        torch.testing.assert_close(layer(one), F.linear(one, layer.weight), rtol=1e-2, atol=1e-2)
        assert torch.equal(layer(two), F.linear(two, layer.weight))
    # Gradients (the draft trainer) and small or oddly sized weights stay with cuBLAS.
    assert not gemv_applies(one, layer.weight)
    small = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    odd = torch.randn(8192, 4160, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert not gemv_applies(one[:, :1024], small)
        assert not gemv_applies(torch.randn(1, 4160, device="cuda", dtype=torch.bfloat16), odd)


def test_on_cpu_linear_is_f_linear():
    layer = Linear(4096, GEMV_MIN_ELEMENTS // 4096, bias=False)
    x = torch.randn(1, 4096)
    assert not gemv_applies(x, layer.weight)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
