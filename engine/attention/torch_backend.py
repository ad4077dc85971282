"""Reference attention on plain torch ops; runs on CPU and GPU.

Decode and short extends (speculative verify and draft extends: a few new tokens per request
after a long cached prefix) compute grouped-query attention for the whole batch at once rather
than through `F.scaled_dot_product_attention`: with a padding mask and fewer KV heads than query
heads, SDPA falls back to its math path, which copies K and V out to every query head at every
layer, and one SDPA call per request costs a host dispatch per request per layer. Here each
request's new tokens are padded to the longest span n, and the G = num_heads / num_kv_heads query
heads that share a KV head are, with their n queries each, the rows of one small matrix product
against that head's keys, so K and V are gathered once per layer and never repeated per query
head. Longer spans (prompts, chunks) keep one SDPA call per request; in a batch that has both
(a mixed step: running requests' next tokens beside prompts), consecutive requests of one token
each still take the batched path together, and only the others are attended one by one.

What every layer attends with (slots, masks, gather rows) is built once per forward, and once per
sliding-window length, in engine.attention.torch_metadata; a window at least as long as every
request's context hides nothing and reuses the full-attention metadata.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.base import AttentionBackend
from engine.attention.torch_metadata import (
    BatchedGroups,
    BatchedMetadata,
    PerRequestMetadata,
    layer_rows,
    prepare_batched,
    prepare_per_request,
)
from engine.executor.forward_batch import ForwardBatch
from engine.scheduling.kv_pool import KVPool

# `torch.bmm(..., out_dtype=torch.float32)` keeps half/bfloat16 attention scores in float32
# (as fused attention kernels do); only CUDA implements it, and only recent torch has it.
_BMM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()

# Extend batches whose every request brings at most this many new tokens take the batched path;
# speculative forwards stay under it (verify: the newest token and k <= ~8 drafts). Padding to the
# longest span makes the float32 scores n times a decode step's, and one long span (a prompt)
# would pad every other request to its length; per request, SDPA pads nothing, its fused kernels
# never hold the scores, and a long span amortises its dispatch.
SHORT_EXTEND_MAX_TOKENS = 16


class TorchAttentionBackend(AttentionBackend):
    supports_sliding_window = True

    def prepare(self, batch: ForwardBatch) -> BatchedGroups | PerRequestMetadata:
        return self._prepare(batch, None)

    def _prepare(
        self, batch: ForwardBatch, window: int | None
    ) -> BatchedGroups | PerRequestMetadata:
        short = max(batch.extend_lens) <= SHORT_EXTEND_MAX_TOKENS
        # On a CPU a lone extending request has no per-request calls to save, and its one SDPA
        # call costs less than the batched path's gathers and products. On a GPU the batched
        # path wins there too: every speculative round brings new sequence lengths, and SDPA's
        # fused kernels cost a host-side setup per new shape (H200, batch 1, prompts of varied
        # length: 76 ms a round through SDPA, 35 ms through the batched path).
        lone_on_cpu = batch.batch_size == 1 and batch.kv_pool.kv_buffer.device.type == "cpu"
        if batch.is_decode or (short and not lone_on_cpu):
            return prepare_batched(batch, self.num_heads, window=window)
        return self._prepare_mixed(batch, window)

    def _metadata(
        self, batch: ForwardBatch, window: int | None
    ) -> BatchedGroups | PerRequestMetadata:
        """The forward's metadata for a layer of this window (None: full attention)."""
        meta = batch.attn_metadata
        # A query at position p sees the keys above p - window: all of them, where the window
        # is as long as the longest context.
        if window is None or window >= max(batch.seq_lens):
            return meta
        windowed = meta.windowed.get(window)
        if windowed is None:
            windowed = meta.windowed[window] = self._prepare(batch, window)
        return windowed

    def _prepare_mixed(self, batch: ForwardBatch, window: int | None) -> PerRequestMetadata:
        """Per-request metadata, with each run of two or more consecutive one-token requests
        given to the batched path."""
        lens = batch.extend_lens
        starts = [0] * len(lens)
        for i in range(1, len(lens)):
            starts[i] = starts[i - 1] + lens[i - 1]
        alone, batched, i = [], [], 0
        while i < len(lens):
            end = i
            while end < len(lens) and lens[end] == 1:
                end += 1
            if end - i >= 2:
                batched += prepare_batched(batch, self.num_heads, i, end, starts[i], window).groups
                i = end
            else:
                alone.append(i)
                i += 1
        return PerRequestMetadata(prepare_per_request(batch, alone, starts, window), batched)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        window: int | None = None,
    ) -> torch.Tensor:
        pool = batch.kv_pool
        pool.write(layer, batch.out_cache_loc, k, v)
        meta = self._metadata(batch, window)
        if isinstance(meta, BatchedGroups):
            if len(meta.groups) == 1:
                return self._batched(q, layer, batch, meta.groups[0][2])
            out = torch.empty_like(q)
            self._batched_groups(q, layer, batch, meta.groups, out)
            return out
        out = torch.empty_like(q)
        self._batched_groups(q, layer, batch, meta.batched, out)
        with _sdpa_backends(q):
            self._per_request(q, k, v, layer, pool, meta, out)
        return out

    def _batched_groups(
        self,
        q: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        groups: list[tuple[int, int, BatchedMetadata]],
        out: torch.Tensor,
    ) -> None:
        for start, count, group in groups:
            out[start : start + count] = self._batched(
                q[start : start + count], layer, batch, group
            )

    def _per_request(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        pool: KVPool,
        meta: PerRequestMetadata,
        out: torch.Tensor,
    ) -> None:
        for start, new, prefix_slots, mask in meta.spans:
            q_i = q[start : start + new].transpose(0, 1)[None]  # [1, H, n, D]
            if prefix_slots is None:
                k_i = k[start : start + new].transpose(0, 1)[None]
                v_i = v[start : start + new].transpose(0, 1)[None]
            else:
                kv = pool.kv_buffer[:, layer][prefix_slots]  # [L, 2, Hkv, D]
                k_i = kv[:, 0].transpose(0, 1)[None]
                v_i = kv[:, 1].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                q_i,
                k_i,
                v_i,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start : start + new] = o[0].transpose(0, 1)

    def _batched(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, meta: BatchedMetadata
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]: each request's n (padded) queries against its cached tokens."""
        num_reqs, _, span, max_len = meta.mask.shape
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        # One gather brings K and V of this layer as [2, B * Hkv, L, D]: each (request, KV head)
        # is one contiguous matrix, so both products below are plain batched matmuls on views.
        kv = layer_rows(batch.kv_pool.kv_buffer, layer).index_select(0, meta.kv_rows)
        kv = kv.view(2, num_reqs * kv_heads, max_len, dim)
        if meta.query_rows is not None:
            q = q.reshape(-1, dim).index_select(0, meta.query_rows)  # [B * H * n, D]
        # Query head h reads KV head h // G (SDPA's enable_gqa), so the G heads of a KV head, n
        # queries each, are adjacent rows of q.
        queries = q.reshape(num_reqs * kv_heads, group * span, dim)
        keys_t = kv[0].transpose(1, 2)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _BMM_HAS_OUT_DTYPE:
            scores = torch.bmm(queries, keys_t, out_dtype=torch.float32)
        else:
            scores = torch.bmm(queries, keys_t).float()
        scores = torch.add(
            meta.mask, scores.view(num_reqs, self.num_heads, span, max_len), alpha=self.scale
        )
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.bmm(weights.view(num_reqs * kv_heads, group * span, max_len), kv[1])
        if meta.output_rows is None:
            return out.view(num_reqs, self.num_heads, dim)
        return out.view(-1, dim).index_select(0, meta.output_rows).view(-1, self.num_heads, dim)


# SDPA's kernels without cuDNN's: cuDNN builds an execution plan for every new shape, and prompt
# and speculative lengths change all the time (H200: 76 -> 42 ms a speculative round at batch 1
# when SDPA ran without it). Flash and memory-efficient attention need no such setup.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(q: torch.Tensor):
    return sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
