"""What rank 0 sends its followers before each forward: which runner method to call and the
ForwardBatch's tensors, so every rank runs the same forward on its shard.

A forward is announced in two or three broadcasts: a fixed header (the order and the sizes),
one int64 block (tokens, positions, KV slots, request rows, lengths, tree masks, and each
request's row of the request-to-token table up to its length, which rank 0 writes when it grants
slots or reuses a cached prefix, outside any forward), and the input embeddings where the batch
has some. A follower writes those table rows into its own table and builds the batch over its
own pools, so its attention reads its own KV heads at the same slots.

Between forwards, rank 0 may announce a KV order instead (its header and one block of slots):
the ranks then gather their KV heads at those slots onto rank 0, or take theirs from the whole
heads rank 0 broadcasts (engine/tensor_parallel/kv_exchange.py), for a transfer between nodes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch, device_batch
from engine.model_runner import ModelRunner
from engine.tensor_parallel.group import RankGroup
from engine.tensor_parallel.kv_exchange import gather_heads, scatter_heads


class Order(enum.IntEnum):
    STOP = 0
    FORWARD = 1  # ModelRunner.forward
    EVERY_TOKEN = 2  # ModelRunner.forward_every_token
    GATHER_KV = 3  # ModelRunner.whole_kv: every KV head at some slots, onto rank 0
    SCATTER_KV = 4  # ModelRunner.write_whole_kv: rank 0's whole heads into each rank's


# order, keep_hidden, tokens, requests, table width, has embeddings, has tree masks (a KV
# order: its number of slots in place of the tokens, the rest 0)
HEADER_SIZE = 7
KV_ORDERS = (Order.GATHER_KV, Order.SCATTER_KV)


@dataclass
class Announced:
    """A forward (or a KV order, with its slots) as a follower receives it."""

    order: Order
    batch: ForwardBatch | None = None
    keep_hidden: bool = False
    slots: torch.Tensor | None = None


def announce_stop(group: RankGroup) -> None:
    group.broadcast(torch.tensor([Order.STOP] + [0] * (HEADER_SIZE - 1), dtype=torch.int64))


def announce_slots(group: RankGroup, order: Order, slots: torch.Tensor) -> None:
    """Rank 0: send a KV order (`KV_ORDERS`) and its slots, before taking part in it."""
    header = [order, 0, len(slots)] + [0] * (HEADER_SIZE - 3)
    group.broadcast(torch.tensor(header, dtype=torch.int64))
    group.broadcast(slots.to(torch.int64).contiguous())


def announce(
    group: RankGroup, order: Order, batch: ForwardBatch, keep_hidden: bool = False
) -> None:
    """Rank 0: send `batch` for `order`, before running it itself."""
    tokens, requests = batch.num_tokens, batch.batch_size
    width = max(batch.seq_lens)
    has_embeds = batch.input_embeds is not None
    has_tree = batch.tree_bits is not None
    header = [order, keep_hidden, tokens, requests, width, has_embeds, has_tree]
    group.broadcast(torch.tensor(header, dtype=torch.int64))
    rows = batch.req_pool_indices[:requests]
    parts = [
        batch.input_ids[:tokens],
        batch.positions[:tokens],
        batch.out_cache_loc[:tokens],
        rows,
        torch.tensor(batch.seq_lens, dtype=torch.int64),
        torch.tensor(batch.extend_lens, dtype=torch.int64),
    ]
    if has_tree:
        parts.append(batch.tree_bits[:tokens])
    if has_embeds:
        parts.append(batch.input_embeds_mask[:tokens].to(torch.int64))
    table = batch.req_to_token_pool.req_to_token[rows, :width]
    parts.append(table.reshape(-1))
    group.broadcast(torch.cat([part.to(torch.int64) for part in parts]))
    if has_embeds:
        group.broadcast(batch.input_embeds[:tokens].contiguous())


def receive(group: RankGroup, runner: ModelRunner) -> Announced:
    """A follower: the next announced forward, its batch built over `runner`'s pools."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64)
    group.broadcast(header)
    order, keep_hidden, tokens, requests, width, has_embeds, has_tree = header.tolist()
    if order == Order.STOP:
        return Announced(Order.STOP)
    if order in KV_ORDERS:
        slots = torch.empty(tokens, dtype=torch.int64)
        group.broadcast(slots)
        return Announced(Order(order), slots=slots)
    size = 3 * tokens + 3 * requests + tokens * (has_tree + has_embeds) + requests * width
    block = torch.empty(size, dtype=torch.int64)
    group.broadcast(block)
    counts = [tokens, tokens, tokens, requests, requests, requests]
    counts += [tokens] * (has_tree + has_embeds) + [requests * width]
    ids, positions, slots, rows, seq_lens, extend_lens, *rest = block.split(counts)
    tree_bits = rest.pop(0) if has_tree else None
    mask = rest.pop(0).bool() if has_embeds else None
    runner.req_to_token_pool.req_to_token[rows, :width] = rest[0].view(requests, width)
    embeds = None
    if has_embeds:
        embeds = torch.empty((tokens, runner.model_config.hidden_size), dtype=runner.config.dtype)
        group.broadcast(embeds)
    batch = device_batch(
        ids,
        positions,
        slots,
        rows,
        seq_lens.tolist(),
        extend_lens.tolist(),
        (runner.kv_pool, runner.req_to_token_pool),
        tree_bits=tree_bits,
        input_embeds=embeds,
        input_embeds_mask=mask,
    )
    batch.attn_metadata = runner.attention.prepare(batch)
    return Announced(Order(order), batch, bool(keep_hidden))


def run_announced(runner: ModelRunner, announced: Announced) -> None:
    """Run the forward (or take the part in the KV order) rank 0 runs, for its collectives;
    its outputs stay unread here."""
    if announced.order in KV_ORDERS:
        shard = runner.shard
        if announced.order == Order.GATHER_KV:
            gather_heads(shard.group, shard.layout, runner.kv_pool, announced.slots)
        else:
            scatter_heads(shard.group, shard.layout, runner.kv_pool, announced.slots)
        return
    assert announced.batch is not None
    if announced.order == Order.FORWARD:
        runner.forward(announced.batch, keep_hidden=announced.keep_hidden)
    else:
        runner.forward_every_token(announced.batch)
