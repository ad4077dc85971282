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

A sliding-window layer's masks are built at its first call in a forward, once per window length,
and kept with the metadata for the other layers of that length; a window at least as long as
every request's context hides nothing and reuses the full-attention metadata. One SDPA call per
request reads only the keys some query of its span may see.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.base import AttentionBackend
from engine.forward_batch import TREE_MAX_TOKENS, ForwardBatch
from engine.kv_pool import KVPool

# `torch.bmm(..., out_dtype=torch.float32)` keeps half/bfloat16 attention scores in float32
# (as fused attention kernels do); only CUDA implements it, and only recent torch has it.
_BMM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()

# Extend batches whose every request brings at most this many new tokens take the batched path;
# speculative forwards stay under it (verify: the newest token and k <= ~8 drafts). Padding to the
# longest span makes the float32 scores n times a decode step's, and one long span (a prompt)
# would pad every other request to its length; per request, SDPA pads nothing, its fused kernels
# never hold the scores, and a long span amortises its dispatch.
SHORT_EXTEND_MAX_TOKENS = 16
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
    # these shifted by l * 2 * Hkv, see `_layer_rows`.
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
            return self._prepare_batched(batch, window=window)
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
                batched += self._prepare_batched(batch, i, end, starts[i], window).groups
                i = end
            else:
                alone.append(i)
                i += 1
        return PerRequestMetadata(_prepare_per_request(batch, alone, starts, window), batched)

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

    def _prepare_batched(
        self,
        batch: ForwardBatch,
        first: int = 0,
        end: int | None = None,
        token: int = 0,
        window: int | None = None,
    ) -> BatchedGroups:
        """Requests first..end-1 (default: all), whose flat tokens begin at `token`."""
        end = batch.batch_size if end is None else end
        groups = []
        for start, stop in self._group_bounds(batch, first, end):
            count = sum(batch.extend_lens[start:stop])
            group = self._prepare_group(batch, start, stop, token, count, window)
            groups.append((token, count, group))
            token += count
        return BatchedGroups(groups)

    def _group_bounds(self, batch: ForwardBatch, first: int, end: int) -> list[tuple[int, int]]:
        """Requests first..end-1 in consecutive groups, each within BATCHED_GROUP_BYTES (a
        request that alone needs more is a group of its own)."""
        pool = batch.kv_pool
        kv_bytes = 2 * pool.num_kv_heads * pool.head_dim * pool.kv_buffer.element_size()
        score_bytes = self.num_heads * max(batch.extend_lens[first:end]) * 4
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
        self,
        batch: ForwardBatch,
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
        padding_rows = _padding_rows(new, span, self.num_heads, num_tokens)
        return BatchedMetadata(slots, mask, kv_rows, *padding_rows)

    def _batched(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, meta: BatchedMetadata
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]: each request's n (padded) queries against its cached tokens."""
        num_reqs, _, span, max_len = meta.mask.shape
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        # One gather brings K and V of this layer as [2, B * Hkv, L, D]: each (request, KV head)
        # is one contiguous matrix, so both products below are plain batched matmuls on views.
        kv = _layer_rows(batch.kv_pool.kv_buffer, layer).index_select(0, meta.kv_rows)
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


def _prepare_per_request(
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


# SDPA's kernels without cuDNN's: cuDNN builds an execution plan for every new shape, and prompt
# and speculative lengths change all the time (H200: 76 -> 42 ms a speculative round at batch 1
# when SDPA ran without it). Flash and memory-efficient attention need no such setup.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(q: torch.Tensor):
    return sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext()


def _kv_rows(slots: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Rows of `_layer_rows(kv_buffer, 0)` for K and V of every (request, KV head, position)."""
    pool = batch.kv_pool
    buffer = pool.kv_buffer
    dim = pool.head_dim
    # The row arithmetic needs the documented slot-major layout stored densely.
    dense = (pool.num_layers, 2, pool.num_kv_heads, dim)
    assert buffer.is_contiguous() and tuple(buffer.shape[1:]) == dense, pool.layout
    per_slot = buffer.stride(0) // dim  # rows of one slot: every layer's K and V heads
    heads = torch.arange(2 * pool.num_kv_heads, device=slots.device).view(2, 1, -1, 1)
    return (slots[None, :, None, :] * per_slot + heads).flatten()


def _layer_rows(buffer: torch.Tensor, layer: int) -> torch.Tensor:
    """kv_buffer as rows of head_dim, starting at layer `layer`'s first head of slot 0, so the
    layer-0 row numbers of `_kv_rows` address that layer."""
    dim = buffer.shape[-1]
    return buffer.view(-1, dim)[layer * buffer.stride(1) // dim :]


def _additive(mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A boolean keep-mask as an additive float mask (0 or -inf), built once per forward rather
    than derived again at every layer."""
    additive = torch.zeros(mask.shape, dtype=batch.kv_pool.dtype, device=mask.device)
    return additive.masked_fill_(~mask, float("-inf"))
