"""What the torch attention backend (engine.attention.torch_backend) prepares once per forward,
before any layer runs, and once more per sliding-window length at the first layer of that length:
which cached slots each request reads, its additive masks (causal, a token tree's ancestors, a
window), and the rows the batched path gathers K, V and queries by. Every layer of the forward
then attends with these, so none of them builds a mask or an index again.

The batched path (decode and short extends) pads each request's queries to the batch's longest
span and groups consecutive requests so that no group holds more than BATCHED_GROUP_BYTES of
gathered KV and scores; the per-request path (long spans) keeps, per request, its prefix's slots
and mask, or nothing for a prompt with no cached prefix (plain causal attention over its own
tokens). A window at least as long as a request's context hides nothing; a per-request span
reads only the keys some query of it may see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.executor.forward_batch import TREE_MAX_TOKENS, ForwardBatch

# What the batched path may hold per layer for one group of requests: their gathered K and V
# (padded to the group's longest context) and their float32 scores. A batch that needs more
# runs in consecutive groups of requests, so a large batch of long contexts never gathers the
# whole batch's KV at once.
BATCHED_GROUP_BYTES = 256 * 2**20


@dataclass
class BatchedMetadata:
    """Decode and short extends: every request's queries padded to n, attended in one batch."""

    slots: torch.Tensor  # [B, L] slots of every cached token, padded with the padding slot
    # [B, 1, n, L] additive: 0 where query j of request i, at position prefix_i + j, may see key
    # position p (p <= prefix_i + j, and within a token tree an ancestor), -inf elsewhere.
    # Causality alone keeps every real query to its request's cached tokens (prefix_i + j <
    # seq_len_i); only padding queries (j >= new_i) reach the padded positions, and their
    # outputs are dropped.
    mask: torch.Tensor
    # [2 * B * Hkv * L] rows of the layer-0 view `kv_buffer.view(-1, head_dim)` holding K (then
    # V) of every cached token, ordered (k/v, request, KV head, position); layer l's rows are
    # these shifted by l * 2 * Hkv, see `layer_rows`.
    kv_rows: torch.Tensor
    # See `_padding_rows`; both None for decode, where the flat tokens are the padded queries.
    query_rows: torch.Tensor | None
    output_rows: torch.Tensor | None


@dataclass
class BatchedGroups:
    """The batched path's metadata per group of consecutive requests, each as (first flat
    token, number of tokens, its metadata); one group unless the batch is large."""

    groups: list[tuple[int, int, BatchedMetadata]]
    # This forward's metadata for each window length its layers asked for.
    windowed: dict[int, BatchedGroups] = field(default_factory=dict)


@dataclass
class PerRequestMetadata:
    """Extends with a long span: one SDPA call per request, but for runs of consecutive
    requests of one new token each (a mixed step's decodes), which take the batched path."""

    # Per request: (first flat token index, new tokens, prefix slots or None, causal mask or None)
    spans: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]
    # The batched path's groups (BatchedGroups.groups) of the runs of one-token requests.
    batched: list[tuple[int, int, BatchedMetadata]] = field(default_factory=list)
    # This forward's metadata for each window length its layers asked for.
    windowed: dict[int, PerRequestMetadata] = field(default_factory=dict)


def prepare_batched(
    batch: ForwardBatch,
    num_heads: int,
    first: int = 0,
    end: int | None = None,
    token: int = 0,
    window: int | None = None,
) -> BatchedGroups:
    """The batched path's metadata of requests first..end-1 (default: all), whose flat tokens
    begin at `token`, for a layer of this window (None: full attention)."""
    end = batch.batch_size if end is None else end
    groups = []
    for start, stop in _group_bounds(batch, num_heads, first, end):
        count = sum(batch.extend_lens[start:stop])
        group = _prepare_group(batch, num_heads, start, stop, token, count, window)
        groups.append((token, count, group))
        token += count
    return BatchedGroups(groups)


def _group_bounds(
    batch: ForwardBatch, num_heads: int, first: int, end: int
) -> list[tuple[int, int]]:
    """Requests first..end-1 in consecutive groups, each within BATCHED_GROUP_BYTES (a
    request that alone needs more is a group of its own)."""
    pool = batch.kv_pool
    kv_bytes = 2 * pool.num_kv_heads * pool.head_dim * pool.kv_buffer.element_size()
    score_bytes = num_heads * max(batch.extend_lens[first:end]) * 4
    seq_lens = batch.seq_lens[first:end]
    per_token = kv_bytes + score_bytes
    if len(seq_lens) * max(seq_lens) * per_token <= BATCHED_GROUP_BYTES:
        return [(first, end)]  # the usual case, without a walk over the requests
    bounds, start, longest = [], first, 0
    for i, seq_len in enumerate(seq_lens, first):
        longest_with = max(longest, seq_len)
        if i > start and (i + 1 - start) * longest_with * per_token > BATCHED_GROUP_BYTES:
            bounds.append((start, i))
            start, longest_with = i, seq_len
        longest = longest_with
    bounds.append((start, end))
    return bounds


def _prepare_group(
    batch: ForwardBatch,
    num_heads: int,
    first: int,
    end: int,
    first_token: int,
    num_tokens: int,
    window: int | None,
) -> BatchedMetadata:
    """Requests first..end-1 of `batch`, whose flat tokens are the `num_tokens` from
    `first_token`."""
    rows = batch.req_to_token_pool.req_to_token
    device = rows.device
    seq_lens, extend_lens = batch.seq_lens[first:end], batch.extend_lens[first:end]
    max_len, span = max(seq_lens), max(extend_lens)
    lens, new = torch.tensor([seq_lens, extend_lens], device=device)
    positions = torch.arange(max_len, device=device)
    cached = positions[None, :] < lens[:, None]  # [B, L]
    # Padded positions read slot 0, a harmless buffer; the mask hides them from every real
    # query.
    slots = rows[batch.req_pool_indices[first:end], :max_len] * cached
    kv_rows = _kv_rows(slots, batch)
    prefixes = lens - new
    query_positions = prefixes[:, None] + torch.arange(span, device=device)  # [B, n]
    keep = positions <= query_positions[:, :, None]  # [B, n, L]
    if batch.tree_bits is not None:
        tree_bits = batch.tree_bits[first_token : first_token + num_tokens]
        offsets = positions[None, None, :] - prefixes[:, None, None]
        keep &= _tree_visible(offsets, _padded_bits(tree_bits, new, span)[:, :, None])
    if window is not None:
        rotary = _padded(batch.positions[first_token : first_token + num_tokens], new, span)
        keep &= positions > rotary[:, :, None] - window
    mask = _additive(keep, batch)[:, None]
    if span == 1:  # one token a request: the flat tokens already are the padded queries
        return BatchedMetadata(slots, mask, kv_rows, query_rows=None, output_rows=None)
    padding_rows = _padding_rows(new, span, num_heads, num_tokens)
    return BatchedMetadata(slots, mask, kv_rows, *padding_rows)


def _padding_rows(
    new: torch.Tensor, span: int, num_heads: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the flat queries `q.reshape(-1, head_dim)` that form the padded queries
    [B, H, n, D], a padding query repeating its request's last token; and rows of the padded
    output `.view(-1, head_dim)` that form the flat output [T, H, D]."""
    device = new.device
    heads = torch.arange(num_heads, device=device)
    starts = new.cumsum(0) - new
    queries = torch.arange(span, device=device)
    tokens = starts[:, None] + torch.minimum(queries, new[:, None] - 1)  # [B, n]
    query_rows = tokens[:, None, :] * num_heads + heads[:, None]  # [B, H, n]
    # output_size spares the device-to-host sync that sizing the result would cost.
    requests = torch.arange(len(new), device=device).repeat_interleave(new, output_size=num_tokens)
    token_queries = torch.arange(num_tokens, device=device) - starts[requests]
    output_rows = (requests[:, None] * num_heads + heads) * span + token_queries[:, None]  # [T, H]
    return query_rows.flatten(), output_rows.flatten()


def prepare_per_request(
    batch: ForwardBatch, requests: list[int], starts: list[int], window: int | None = None
) -> list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]:
    """`PerRequestMetadata.spans` of these requests (indices into the batch, whose first flat
    tokens are `starts`), for a layer of this window (None: full attention)."""
    if not requests:
        return []
    rows = batch.req_to_token_pool.req_to_token
    device = rows.device
    spans = []
    # Requests with a cached prefix take views of one gather of slots and one arange, so
    # none of them costs its own copy from the host.
    max_len = max(batch.seq_lens)
    request_slots = rows[batch.req_pool_indices, :max_len]
    positions = torch.arange(max_len, device=device)
    for i in requests:
        seq_len, new, start = batch.seq_lens[i], batch.extend_lens[i], starts[i]
        prefix = seq_len - new
        # A longer span has no `visible` (its bits are all set): plain causal.
        tree = batch.tree_bits is not None and new <= TREE_MAX_TOKENS
        windowed = window is not None and window < seq_len
        if prefix == 0 and not tree and not windowed:
            spans.append((start, new, None, None))
            continue
        # Every query of the span sits at rotary position `prefix` or later, so no query sees
        # a key at or below prefix - window: those are not read at all.
        first = max(0, prefix - window + 1) if windowed else 0
        keys = positions[first:seq_len]
        keep = keys[None, :] <= positions[prefix:seq_len, None]
        if tree:
            bits = batch.tree_bits[start : start + new, None]
            keep &= _tree_visible(keys - prefix, bits)
        if windowed:
            keep &= keys[None, :] > batch.positions[start : start + new, None] - window
        # Without a prefix the new tokens' own K and V are all the keys.
        slots = request_slots[i, first:seq_len] if prefix else None
        spans.append((start, new, slots, _additive(keep, batch)))
    return spans


def _tree_visible(offsets: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Whether a query of span bitmask `bits` may see a key `offsets` after its span's first
    token (broadcast together): any key cached before the span, and the span's tokens whose bit
    is set. Offsets past the last bit occur only in spans without a tree (bits -1), where any
    bit reads set: clamping keeps the shift defined."""
    in_span = (bits >> offsets.clamp(0, TREE_MAX_TOKENS - 1)) & 1
    return (offsets < 0) | in_span.bool()


def _padded(values: torch.Tensor, new: torch.Tensor, span: int) -> torch.Tensor:
    """Flat per-token values [T] as [B, n], each request's queries padded to n with its last
    token's value."""
    queries = torch.arange(span, device=new.device)
    starts = new.cumsum(0) - new
    return values[starts[:, None] + torch.minimum(queries, new[:, None] - 1)]


def _padded_bits(tree_bits: torch.Tensor, new: torch.Tensor, span: int) -> torch.Tensor:
    """Flat per-token bits [T] as [B, n], each request's queries padded to n with -1."""
    queries = torch.arange(span, device=new.device)
    return _padded(tree_bits, new, span).masked_fill_(queries >= new[:, None], -1)


def _kv_rows(slots: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Rows of `layer_rows(kv_buffer, 0)` for K and V of every (request, KV head, position)."""
    pool = batch.kv_pool
    buffer = pool.kv_buffer
    dim = pool.head_dim
    # The row arithmetic needs the documented slot-major layout stored densely.
    dense = (pool.num_layers, 2, pool.num_kv_heads, dim)
    assert buffer.is_contiguous() and tuple(buffer.shape[1:]) == dense, pool.layout
    per_slot = buffer.stride(0) // dim  # rows of one slot: every layer's K and V heads
    heads = torch.arange(2 * pool.num_kv_heads, device=slots.device).view(2, 1, -1, 1)
    return (slots[None, :, None, :] * per_slot + heads).flatten()


def layer_rows(buffer: torch.Tensor, layer: int) -> torch.Tensor:
    """kv_buffer as rows of head_dim, starting at layer `layer`'s first head of slot 0, so the
    layer-0 row numbers of `_kv_rows` address that layer."""
    dim = buffer.shape[-1]
    return buffer.view(-1, dim)[layer * buffer.stride(1) // dim :]


def _additive(mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A boolean keep-mask as an additive float mask (0 or -inf), built once per forward rather
    than derived again at every layer."""
    additive = torch.zeros(mask.shape, dtype=batch.kv_pool.dtype, device=mask.device)
    return additive.masked_fill_(~mask, float("-inf"))
