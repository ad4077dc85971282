"""Attention backends, chosen by name through a registry with lazy imports."""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend

_BACKENDS = {
    "torch": "engine.attention.torch_backend:TorchAttentionBackend",
    "triton": "engine.attention.triton_backend:TritonAttentionBackend",
}
# "auto": Triton where it runs (a CUDA device with Triton installed), torch elsewhere.
AUTO = "auto"
SUPPORTED_BACKENDS = (AUTO, *_BACKENDS)


def resolve_attention_backend(name: str, device: str) -> str:
    """The backend an engine on `device` runs for the user's choice `name`; refuses unknown
    names and Triton where it cannot run."""
    from engine.kernels import triton_runs_on

    if name not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; supported: {', '.join(SUPPORTED_BACKENDS)}"
        )
    triton_runs = triton_runs_on(device)
    if name == AUTO:
        return "triton" if triton_runs else "torch"
    if name == "triton" and not triton_runs:
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device with Triton installed, not {device!r}"
        )
    return name


def create_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; supported: {', '.join(sorted(_BACKENDS))}"
        )
    module_name, class_name = _BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(num_heads, num_kv_heads, head_dim)


__all__ = [
    "AUTO",
    "SUPPORTED_BACKENDS",
    "AttentionBackend",
    "create_attention_backend",
    "resolve_attention_backend",
]
