"""Fused GPU kernels (Triton) for the decoder's elementwise work and for paged attention.

Triton ships with PyTorch's CUDA wheels and is absent from its CPU wheels, so nothing here
imports it at module load: `triton_usable` says whether a tensor can take the Triton path, and
the kernel modules are imported only then. On a CPU every caller keeps its plain torch code,
which is also the reference the kernels are tested against."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(x: torch.Tensor) -> bool:
    """Whether an inference op on `x` takes the Triton path: `x` lives where the kernels run
    (a CUDA device, Triton installed), and nothing needs what they lack: a backward pass (the
    draft trainer runs the same modules with gradients) or autocast's dtype promotion."""
    return (
        x.is_cuda
        and _triton_installed()
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled(x.device.type)
    )


def triton_runs_on(device: str | torch.device) -> bool:
    """Whether the Triton kernels run on `device`."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _triton_installed()
