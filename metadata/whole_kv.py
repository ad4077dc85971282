"""The target's KV on the wire holds every KV head of the model, whatever ranks either node has:
a node whose runner splits its KV heads over tensor parallel ranks (`ModelRunner.splits_kv`)
sends from, and receives into, a staging pool of whole heads, and its runner gathers the ranks'
heads into it (prefill side) or writes them out of it into each rank's pool (decode side). So a
prefill node of TP a pairs with a decode node of TP b for any a and b, and the transfer's
messages, their order and the `TransferSpec` are a one-rank node's.

Only the target's pool is staged: the draft depths' pools are rank 0's alone, whole already.
The slots staged are exactly those the transfer carries (after the decode node's reused
prefix, decode_node.reuse)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner

PoolsAndSlots = list[tuple[KVPool, list[int]]]


def whole_pool(runner: ModelRunner, num_tokens: int) -> KVPool:
    """A pool of every KV head of the model with `num_tokens` slots, [1, num_tokens]."""
    pool = runner.kv_pool
    heads = runner.model_config.num_kv_heads
    return KVPool(
        max(1, num_tokens), pool.num_layers, heads, pool.head_dim, pool.dtype, pool.device
    )


def wire_pool(runner: ModelRunner) -> KVPool:
    """A pool shaped as the target's KV on the wire (for the sizes of its messages)."""
    return whole_pool(runner, 1) if runner.splits_kv else runner.kv_pool


def _slot_index(slots: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(slots, dtype=np.int64))


def _staged(num_tokens: int) -> list[int]:
    return list(range(1, num_tokens + 1))


def outgoing_pools(runner: ModelRunner, pools: PoolsAndSlots, read: bool = True) -> PoolsAndSlots:
    """A prefill node's pools for `KVSender.send`: the target's slots replaced by a staging
    pool of whole heads, gathered from the ranks (`read=False`: left as zeros, for a void
    transfer, whose content means nothing). Called on the thread that runs the forwards: the
    gather is a collective of the ranks, ordered with theirs."""
    if not runner.splits_kv:
        return pools
    out = []
    for pool, slots in pools:
        if pool is runner.kv_pool and slots:
            staging = whole_pool(runner, len(slots))
            if read:
                runner.whole_kv(_slot_index(slots), out=staging.kv_buffer[1:])
            pool, slots = staging, _staged(len(slots))
        out.append((pool, slots))
    return out


@dataclass
class WholeLanding:
    """A decode node's staged target KV: where it lands whole, and the request's slots it goes
    to once it has landed (`write`)."""

    staging: KVPool
    slots: list[int]

    def write(self, runner: ModelRunner) -> None:
        """Write the landed KV into every rank's heads; on the thread that runs the forwards."""
        n = len(self.slots)
        runner.write_whole_kv(_slot_index(self.slots), self.staging.kv_buffer[1 : n + 1])


def incoming_pools(
    runner: ModelRunner, pools: PoolsAndSlots
) -> tuple[PoolsAndSlots, WholeLanding | None]:
    """A decode node's pools for `KVReceiver.expect`: the target's slots replaced by a staging
    pool of whole heads, and what to write where once the transfer landed (None: the pools are
    the runner's own, or the transfer carries no target KV)."""
    if not runner.splits_kv:
        return pools, None
    out, landing = [], None
    for pool, slots in pools:
        if pool is runner.kv_pool and slots:
            landing = WholeLanding(whole_pool(runner, len(slots)), list(slots))
            pool, slots = landing.staging, _staged(len(slots))
        out.append((pool, slots))
    return out, landing
