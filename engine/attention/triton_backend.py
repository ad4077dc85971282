"""Paged attention on the GPU through Triton kernels (engine/kernels), capturable by CUDA graphs.

A forward's metadata is four [B] device tensors (each request's row, its length after the
forward, its first token in the flat batch, its new tokens) and two launch sizes (the longest
span, the number of key splits). Rotary embedding and the KV write are one kernel
(`rotate_and_attend`), attention another, per layer.

For a CUDA graph the graph runner owns the rows and lengths in buffers of fixed capacity and
fills them before each replay; `prepare_for_capture` builds metadata over those buffers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.executor.forward_batch import ForwardBatch
from engine.executor.host_copy import int_tensor
from engine.kernels.attention import paged_attention
from engine.kernels.elementwise import rope_and_store

# At most this many parts of one sequence's keys are attended by separate programs in decode.
MAX_KEY_SPLITS = 16


@dataclass
class TritonMetadata:
    rows: torch.Tensor  # [B] int64, each request's row in the request table
    seq_lens: torch.Tensor  # [B] int64, tokens cached after this forward
    q_starts: torch.Tensor  # [B] int64, first new token of the request in the flat batch
    q_lens: torch.Tensor  # [B] int64, new tokens of the request
    max_q_len: int
    num_splits: int
    tree_bits: torch.Tensor | None = None  # ForwardBatch.tree_bits


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_sliding_window = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._num_sms: int | None = None

    def prepare(self, batch: ForwardBatch) -> TritonMetadata:
        device = batch.input_ids.device
        starts = [0, *itertools.accumulate(batch.extend_lens)][:-1]
        lengths = int_tensor([batch.seq_lens, starts, batch.extend_lens], device)
        max_q_len = max(batch.extend_lens)
        return TritonMetadata(
            batch.req_pool_indices,
            lengths[0],
            lengths[1],
            lengths[2],
            max_q_len,
            self._key_splits(batch.batch_size, max_q_len, device),
            batch.tree_bits,
        )

    def prepare_for_capture(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        max_q_len: int,
        tree_bits: torch.Tensor | None = None,
    ) -> TritonMetadata:
        """Metadata over a graph's static [B] buffers, which the graph runner fills before
        each replay: the kernels read them where they are, so replay needs nothing more
        (`AttentionBackend.prepare_for_capture`)."""
        splits = self._key_splits(rows.shape[0], max_q_len, rows.device)
        return TritonMetadata(rows, seq_lens, q_starts, q_lens, max_q_len, splits, tree_bits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        window: int | None = None,
    ) -> torch.Tensor:
        batch.kv_pool.write(layer, batch.out_cache_loc, k, v)
        return self._attend(q, layer, batch, window)

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
        pool = batch.kv_pool
        q = rope_and_store(
            q, k, v, cos, sin, batch.out_cache_loc, pool.k_buffers[layer], pool.v_buffers[layer]
        )
        return self._attend(q, layer, batch, window)

    def _attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, window: int | None
    ) -> torch.Tensor:
        meta: TritonMetadata = batch.attn_metadata
        pool = batch.kv_pool
        return paged_attention(
            q,
            pool.k_buffers[layer],
            pool.v_buffers[layer],
            batch.req_to_token_pool.req_to_token,
            meta.rows,
            meta.seq_lens,
            meta.q_starts,
            meta.q_lens,
            meta.max_q_len,
            self.scale,
            meta.num_splits,
            tree_bits=meta.tree_bits,
            # A graph's batch holds its positions in the static buffer: the kernel reads them
            # at each replay.
            window=window,
            positions=batch.positions if window is not None else None,
        )

    def _key_splits(self, batch_size: int, max_q_len: int, device: torch.device) -> int:
        """Decode with fewer (request, KV head) programs than the GPU has multiprocessors
        splits every sequence's keys, so that the GPU is busy whatever the batch."""
        if max_q_len != 1:
            return 1
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = batch_size * self.num_kv_heads
        return max(1, min(MAX_KEY_SPLITS, self._num_sms // programs))
