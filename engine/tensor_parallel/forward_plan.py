"""What rank 0 sends its followers before each forward: which runner method to call and the
ForwardBatch's tensors, so every rank runs the same forward on its shard.

A forward is announced in two or three broadcasts: a fixed header (the order and the sizes),
one int64 block (tokens, positions, KV slots, request rows, lengths, tree masks, and each
request's row of the request-to-token table up to its length, which rank 0 writes when it grants
slots or reuses a cached prefix, outside any forward), and the input embeddings where the batch
has some. A follower writes those table rows into its own table and builds the batch over its
own pools, so its attention reads its own KV heads at the same slots.

Between forwards, rank 0 may announce an order on the ranks' KV links instead
(engine/tensor_parallel/link_orders.py): each rank then sends or receives its own KV heads of a
transfer between nodes straight to or from the other node's ranks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.executor.forward_batch import ForwardBatch, device_batch
from engine.executor.model_runner import ModelRunner
from engine.tensor_parallel.group import RankGroup
from engine.tensor_parallel.kv_links import KVLinks
from engine.tensor_parallel.link_orders import (
    LinkOrder,
    gather_status,
    gathers_status,
    run_link_order,
)
from engine.tensor_parallel.orders import HEADER_SIZE, LINK_ORDERS, Order

log = logging.getLogger(__name__)


@dataclass
class Announced:
    """A forward (or a link order) as a follower receives it."""

    order: Order
    batch: ForwardBatch | None = None
    keep_hidden: bool = False
    link_order: LinkOrder | None = None


def announce_stop(group: RankGroup) -> None:
    group.broadcast(torch.tensor([Order.STOP] + [0] * (HEADER_SIZE - 1), dtype=torch.int64))


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
    if order in LINK_ORDERS:
        return Announced(Order(order), link_order=LinkOrder.receive(group, header.tolist()))
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


def run_announced(runner: ModelRunner, announced: Announced, links: KVLinks) -> None:
    """Run the forward (or do the link order on `links`, this rank's) rank 0 runs, for its
    collectives; its outputs stay unread here."""
    if announced.link_order is not None:
        group = runner.shard.group
        order = announced.link_order
        if gathers_status(order):
            # A failure is this rank's status (run_link_order): the gather is always reached.
            gather_status(group, run_link_order(links, order, group.rank))
            return
        try:
            run_link_order(links, order, group.rank)
        except Exception:  # noqa: BLE001 - rank 0 waits for no status: the rank keeps serving
            # What did not happen shows where the order's transfer lands (its heads fail).
            log.exception("rank %d: link order %s failed", group.rank, Order(order.kind).name)
        return
    assert announced.batch is not None
    if announced.order == Order.FORWARD:
        runner.forward(announced.batch, keep_hidden=announced.keep_hidden)
    else:
        runner.forward_every_token(announced.batch)
