"""ForwardBatch from explicit spans (row, first position, tokens, slots): verify and the draft
depths feed tokens that are not a Request's committed tokens, into pools of their choosing."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend
from engine.forward_batch import ForwardBatch, Span
from engine.host_copy import int_tensor
from engine.kv_pool import KVPool, ReqToTokenPool
from engine.prompt_embeds import concat_input_embeds

__all__ = ["Span", "extend_batch"]


def extend_batch(
    spans: list[Span],
    kv_pool: KVPool,
    req_to_token_pool: ReqToTokenPool,
    backend: AttentionBackend,
    device: torch.device,
) -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for span in spans:
        assert len(span.slots) == len(span.token_ids) > 0
        ids.extend(span.token_ids)
        positions.extend(range(span.start, span.start + len(span.token_ids)))
        slots.extend(span.slots)

    def tensor(values: list[int]) -> torch.Tensor:
        return int_tensor(values, device)

    input_embeds, input_embeds_mask = concat_input_embeds(
        [span.input_embeds for span in spans], [len(span.token_ids) for span in spans], device
    )
    batch = ForwardBatch(
        input_ids=tensor(ids),
        positions=tensor(positions),
        out_cache_loc=tensor(slots),
        req_pool_indices=tensor([span.row for span in spans]),
        seq_lens=[span.start + len(span.token_ids) for span in spans],
        extend_lens=[len(span.token_ids) for span in spans],
        kv_pool=kv_pool,
        req_to_token_pool=req_to_token_pool,
        input_embeds=input_embeds,
        input_embeds_mask=input_embeds_mask,
    )
    batch.attn_metadata = backend.prepare(batch)
    return batch
