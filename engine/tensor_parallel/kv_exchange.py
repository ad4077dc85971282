"""The target's KV as it crosses between nodes when a node has ranks: every KV head of the model
at some slots, gathered onto rank 0 from the ranks that hold them (a prefill node's transfer),
or written from rank 0 into each rank's heads (a decode node's landed transfer).

Every rank calls these, rank 0 after announcing the order (forward_plan.announce_slots), so the
collectives pair up in the same order as the forwards'. A KV head replicated on several ranks
(fewer KV heads than ranks) is taken once, from the first rank that holds it. Tensors cross as
bytes, whatever the KV dtype."""

from __future__ import annotations

import torch

from engine.kv_pool import KVPool
from engine.tensor_parallel.group import RankGroup
from engine.tensor_parallel.layout import TensorParallelLayout


def whole_kv_shape(layout: TensorParallelLayout, pool: KVPool, num_tokens: int) -> tuple:
    """[n, num_layers, 2 (K, V), the model's num_kv_heads, head_dim]: one-rank pool rows."""
    return (num_tokens, pool.num_layers, 2, layout.num_kv_heads, pool.head_dim)


def gather_heads(
    group: RankGroup,
    layout: TensorParallelLayout,
    pool: KVPool,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Rank 0: every KV head at `slots` (into `out` when given); the others: None."""
    local = pool.kv_buffer.index_select(0, slots.to(pool.device))
    parts = group.all_gather(local.view(torch.uint8))
    if not group.leads:
        return None
    # Rank r holds heads [first_kv_head(r), + local_kv_heads): the ranks a replica apart hold
    # consecutive heads, each once.
    holders = range(0, group.size, layout.kv_replicas)
    heads = [parts[rank].view(pool.dtype) for rank in holders]
    if out is None:
        return torch.cat(heads, dim=3)
    torch.cat(heads, dim=3, out=out)
    return out


def scatter_heads(
    group: RankGroup,
    layout: TensorParallelLayout,
    pool: KVPool,
    slots: torch.Tensor,
    kv: torch.Tensor | None = None,
) -> None:
    """Write each rank's KV heads of `kv` (every head, [n, layers, 2, heads, dim], given on
    rank 0 only) at `slots` of its pool."""
    if group.leads:
        assert kv is not None
        whole = kv.contiguous()
    else:
        whole = torch.empty(
            whole_kv_shape(layout, pool, len(slots)), dtype=pool.dtype, device=pool.device
        )
    group.broadcast(whole.view(torch.uint8))
    first = layout.first_kv_head(group.rank)
    own = whole[:, :, :, first : first + layout.local_kv_heads]
    pool.kv_buffer.index_copy_(0, slots.to(pool.device), own.contiguous())
