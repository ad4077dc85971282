"""The attention backend interface: per-forward metadata once, then one call per layer.

A backend writes the new tokens' K and V into the KV pool at `batch.out_cache_loc` and attends
each new query to its request's cached tokens (positions < seq_len) causally; where
`batch.tree_bits` is set, a query of a token tree sees, of its own span, only the tokens its
bitmask names (its ancestors and itself). A layer of sliding-window attention passes its
`window` W: a query at rotary position p (`batch.positions`) then sees only the cached
positions above p - W. A token tree's node sits at its cache position or after it (its rotary
position is its level), so the rule keeps the target's own window for its ancestors too while
a tree is shallower than W (trees hold at most 63 tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    # Whether `prepare_for_capture` is implemented: its metadata lives in device buffers a CUDA
    # graph can read at replay.
    supports_cuda_graph = False
    # Whether `forward` takes a sliding window (its `window` keyword).
    supports_sliding_window = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> Any:
        """Build what every layer of this forward shares (indices, masks); stored on the batch."""

    def prepare_for_capture(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        max_q_len: int,
        tree_bits: torch.Tensor | None = None,
    ) -> Any:
        """The capture hook of a graph runner (engine.executor.graph_capture's callers): metadata
        over its static [B] buffers (each request's row, length after the forward, first new token
        in the flat batch, new tokens; `tree_bits` as `ForwardBatch.tree_bits`), which the runner
        fills before each replay, for spans of at most `max_q_len` tokens. The kernels must read the
        buffers where they are, so that a replay needs no metadata work. By default a backend cannot
        be captured (`supports_cuda_graph` False) and refuses."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] of the new tokens -> attention output [T, H, D].
        A backend that `supports_sliding_window` takes `window: int | None = None` too."""

    def rotate_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        window: int | None = None,
    ) -> torch.Tensor:
        """`forward` for q and k before their rotary embedding (cos, sin: [T, 1, D]); a
        backend may fuse the rotation with its KV write. `window`: the layer's sliding window,
        None for full attention."""
        # Imported here: engine.models imports this module.
        from engine.models.rope import apply_rotary

        q, k = apply_rotary(q, k, cos, sin)
        if window is None:
            return self.forward(q, k, v, layer, batch)
        if not self.supports_sliding_window:
            raise UnsupportedModelError(
                f"{type(self).__name__} does not implement sliding-window attention"
            )
        return self.forward(q, k, v, layer, batch, window=window)
