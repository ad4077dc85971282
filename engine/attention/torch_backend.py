"""Reference attention on torch's scaled_dot_product_attention; runs on CPU and GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch


@dataclass
class DecodeMetadata:
    slots: torch.Tensor  # [B, L] slots of every cached token, padded with the padding slot
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 where a real token is, -inf elsewhere


@dataclass
class ExtendMetadata:
    # Per request: (first flat token index, new tokens, prefix slots or None, causal mask or None)
    spans: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        rows = batch.req_to_token_pool.req_to_token
        device = rows.device
        if batch.is_decode:
            max_len = max(batch.seq_lens)
            lens = torch.tensor(batch.seq_lens, device=device)
            mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            # Padded positions read slot 0, a harmless buffer; the mask hides them.
            slots = rows[batch.req_pool_indices, :max_len] * mask
            return DecodeMetadata(slots=slots, mask=_additive(mask, batch)[:, None, None, :])
        spans = []
        start = 0
        for i, (seq_len, new) in enumerate(zip(batch.seq_lens, batch.extend_lens)):
            prefix = seq_len - new
            if prefix == 0:
                spans.append((start, new, None, None))
            else:
                slots = rows[batch.req_pool_indices[i], :seq_len]
                q_pos = torch.arange(prefix, seq_len, device=device)[:, None]
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos
                spans.append((start, new, slots, _additive(mask, batch)))
            start += new
        return ExtendMetadata(spans=spans)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.kv_pool
        pool.write(layer, batch.out_cache_loc, k, v)
        meta = batch.attn_metadata
        if isinstance(meta, DecodeMetadata):
            # One gather brings K and V of this layer: [B, L, 2, Hkv, D].
            kv = pool.kv_buffer[:, layer][meta.slots]
            keys = kv[:, :, 0].transpose(1, 2)  # [B, Hkv, L, D]
            values = kv[:, :, 1].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q[:, :, None, :],
                keys,
                values,
                attn_mask=meta.mask,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            return out[:, :, 0, :]
        out = torch.empty_like(q)
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
        return out


def _additive(mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A boolean keep-mask as the additive float mask SDPA would derive from it at every layer:
    built once per forward instead."""
    additive = torch.zeros(mask.shape, dtype=batch.kv_pool.dtype, device=mask.device)
    return additive.masked_fill_(~mask, float("-inf"))
