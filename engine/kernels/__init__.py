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
    """Whether `x` lives where the Triton kernels run (a CUDA device, Triton installed)."""
    return x.is_cuda and _triton_installed()


def triton_runs_on(device: str | torch.device) -> bool:
    """Whether the Triton kernels run on `device`."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _triton_installed()
