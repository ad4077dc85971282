"""Linear layers with weights prepacked for oneDNN, for float32 inference on CPU.

PyTorch's default CPU matmul path re-reads each weight in its plain layout at every call; oneDNN
with a weight reordered once into its blocked layout runs the same products two to four times
faster on AVX-512 machines, at batch 1 as at batch 64 (bench/offline.py shows the effect). The
results differ from the plain path only by float32 rounding order."""

from __future__ import annotations

import torch
from torch import nn

# The layout is chosen for this many rows; any other row count still works.
PACKING_BATCH_HINT = 16


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    try:  # some builds expose the op without the kernels for this CPU
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), PACKING_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), weight, None, "none", [], "")
        return bool(torch.allclose(out, torch.full((2, 4), 4.0)))
    except RuntimeError:
        return False


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
        )
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear below `module` by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
