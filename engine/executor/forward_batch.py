"""ForwardBatch: everything one forward pass needs, passed to the model explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.executor.host_copy import int_tensor
from engine.executor.prompt_embeds import InputEmbeds, concat_input_embeds
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool

if TYPE_CHECKING:
    from engine.attention import AttentionBackend

# Bits of an int64 that a span's visibility mask may use: the sign bit stays clear, so that -1
# (every bit) can stand for a causal span in a batch with trees.
TREE_MAX_TOKENS = 63


@dataclass
class Span:
    """What one request brings to a forward: its row in the request table, the position of its
    first new token (positions below are cached), the new tokens and the KV slot each writes
    (already in the row)."""

    row: int
    start: int
    token_ids: list[int]
    slots: list[int]
    input_embeds: InputEmbeds | None = None  # rows that replace some tokens' embeddings
    # Rotary position of each token; None: start, start + 1, ... (a draft token tree gives each
    # node start + its level, its cache position staying start + its index).
    positions: list[int] | None = None
    # Per token, a bitmask over the span's tokens it may attend (bit i: token i; its own bit is
    # always set); None: causal. A draft token tree lets a node see its ancestors and itself.
    # At most TREE_MAX_TOKENS tokens.
    visible: list[int] | None = None


@dataclass
class ForwardBatch:
    """A batch of requests, each extending its cached prefix by one or more new tokens.

    Tokens of all requests are flattened into one sequence of length T; request i owns the
    `extend_lens[i]` tokens after those of requests < i. Decode is the case where every request
    extends by exactly one token.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, the KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B] int64, each request's row in req_to_token_pool
    seq_lens: list[int]  # [B] tokens in the cache after this forward
    extend_lens: list[int]  # [B] new tokens in this forward
    kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    # Optional per-token input embeddings [T, hidden]; rows where `input_embeds_mask` is True
    # replace the token embedding (prompt embeddings, multimodal placeholders).
    input_embeds: torch.Tensor | None = None
    input_embeds_mask: torch.Tensor | None = None
    # [T] int64 where some span has `visible`: each token's bitmask over its span's tokens. A
    # query at span index j of a request with `prefix` cached tokens sees cache position p iff
    # p <= prefix + j and (p < prefix or bit p - prefix is set); -1 (spans without `visible`)
    # is causal, however long the span. None: every span causal.
    tree_bits: torch.Tensor | None = None
    attn_metadata: Any = field(default=None, repr=False)
    # [B] each request's last new token in the flat sequence, on the device, when the batch's
    # builder has it there already (a CUDA graph's static buffer); else computed on demand.
    last_index: torch.Tensor | None = None
    # Set when the batch sits in a CUDA graph's static buffers: the graph set that holds it
    # (engine.executor.cuda_graph.CudaGraphs) and the captured size it is padded to.
    graph: Any = field(default=None, repr=False)
    graph_batch_size: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.batch_size

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    def last_token_indices(self) -> torch.Tensor:
        """Index in the flat token sequence of each request's last new token."""
        if self.last_index is not None:
            return self.last_index
        if self.is_decode:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        ends = int_tensor(self.extend_lens, self.input_ids.device).cumsum(0)
        return ends - 1

    def set_tokens(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """The tokens at `indices` of the flat sequence become `values`, in place: in a batch
        that a graph's static buffers hold, where the graph reads them."""
        self.input_ids.index_copy_(0, indices, values)

    def set_span_tails(self, tails: torch.Tensor) -> None:
        """Each of the batch's first n spans, all of w tokens, brings tails[i] ([n, w - 1])
        after its first token, in place (as `set_tokens`): a verify's drafts, written on the
        device after the batch was built."""
        n, rest = tails.shape
        self.input_ids[: n * (rest + 1)].view(n, rest + 1)[:, 1:].copy_(tails)


def extend_batch(
    spans: list[Span],
    kv_pool: KVPool,
    req_to_token_pool: ReqToTokenPool,
    backend: AttentionBackend,
    device: torch.device,
    embeds_dtype: torch.dtype | None = None,
) -> ForwardBatch:
    """An eager batch of explicit spans, into pools of the caller's choosing: the engine's
    prefill and decode steps, speculative verify (tokens not committed yet), the draft depths.
    `embeds_dtype`: of the vectors given for some tokens (default: as given)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for span in spans:
        assert len(span.slots) == len(span.token_ids) > 0
        ids.extend(span.token_ids)
        if span.positions is None:
            positions.extend(range(span.start, span.start + len(span.token_ids)))
        else:
            assert len(span.positions) == len(span.token_ids)
            positions.extend(span.positions)
        slots.extend(span.slots)
    has_tree = any(span.visible is not None for span in spans)
    input_embeds, input_embeds_mask = concat_input_embeds(
        [span.input_embeds for span in spans],
        [len(span.token_ids) for span in spans],
        device,
        embeds_dtype,
    )
    batch = device_batch(
        int_tensor(ids, device),
        int_tensor(positions, device),
        int_tensor(slots, device),
        int_tensor([span.row for span in spans], device),
        [span.start + len(span.token_ids) for span in spans],
        [len(span.token_ids) for span in spans],
        (kv_pool, req_to_token_pool),
        input_embeds=input_embeds,
        input_embeds_mask=input_embeds_mask,
        tree_bits=int_tensor(tree_bits(spans), device) if has_tree else None,
    )
    batch.attn_metadata = backend.prepare(batch)
    return batch


def device_batch(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    pools: tuple[KVPool, ReqToTokenPool],
    *,
    tree_bits: torch.Tensor | None = None,
    input_embeds: torch.Tensor | None = None,
    input_embeds_mask: torch.Tensor | None = None,
    last_index: torch.Tensor | None = None,
    graph: Any = None,
    graph_batch_size: int | None = None,
) -> ForwardBatch:
    """A batch whose per-token and per-request tensors are on the device already (views of a
    CUDA graph's static buffers, or of the fixed-shape draft extend's, or `extend_batch`'s
    copies): nothing is copied from the host. Its attention metadata is the caller's to set:
    a backend's `prepare` for an eager forward, `prepare_for_capture` over the buffers for a
    captured one, none for a replay."""
    kv_pool, req_to_token_pool = pools
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        kv_pool=kv_pool,
        req_to_token_pool=req_to_token_pool,
        input_embeds=input_embeds,
        input_embeds_mask=input_embeds_mask,
        tree_bits=tree_bits,
        last_index=last_index,
        graph=graph,
        graph_batch_size=graph_batch_size,
    )


def tree_bits(spans: list[Span]) -> list[int]:
    """`ForwardBatch.tree_bits` of these spans, flat."""
    bits: list[int] = []
    for span in spans:
        n = len(span.token_ids)
        if span.visible is None:
            bits.extend([-1] * n)
            continue
        assert len(span.visible) == n <= TREE_MAX_TOKENS, (len(span.visible), n)
        # Bits above j are hidden by causality anyway; dropping them keeps every mask below
        # the sign bit.
        bits.extend((mask | 1 << j) & ((2 << j) - 1) for j, mask in enumerate(span.visible))
    return bits


def ancestor_bits(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """`tree_bits` of token trees on the device: parents [n, count] (each node's parent node,
    -1 for the root; a node's ancestors at most `depth` levels above it) to [n, count + 1]
    masks over each span (the root, then the nodes), each row seeing itself, the root and its
    ancestors."""
    n, count = parents.shape
    rows = torch.arange(1, count + 1, device=parents.device)
    own = torch.ones_like(rows) << rows
    bits = torch.ones((n, count + 1), dtype=torch.int64, device=parents.device)
    nodes = own | 1
    parent = parents
    for _ in range(depth):
        up = parent >= 0
        nodes = nodes | torch.where(up, torch.ones_like(parent) << (parent + 1), 0)
        parent = torch.where(up, parents.gather(1, parent.clamp_min(0)), -1)
    bits[:, 1:] = nodes
    return bits
