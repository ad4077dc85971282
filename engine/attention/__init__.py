"""Attention backends, chosen by name through a registry with lazy imports."""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend

_BACKENDS = {
    "torch": "engine.attention.torch_backend:TorchAttentionBackend",
}


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


__all__ = ["AttentionBackend", "create_attention_backend"]
