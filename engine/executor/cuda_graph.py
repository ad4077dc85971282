"""Forwards captured as CUDA graphs and replayed with the batch padded to a captured size: a
replay costs one launch where the eager forward costs one host dispatch per kernel (about ten
a layer).

A graph set (`CudaGraphs`) serves batches whose requests each bring at most `max_span` new
tokens: decode (span 1), captured per batch size, and speculative verify (the newest token
and the draft chain, or an alternative chain), captured per token count. A graph reads its
inputs from one static buffer (per token: id, position, KV slot; per request: row, length,
first token, new tokens; engine.executor.graph_inputs), filled by one host-to-device copy per step.
Padded tokens write their K and V to the padding slot, so they never touch a request's KV;
their outputs are sliced off before anything (sampling, acceptance, statistics, a transfer)
sees them.

The graph runner touches attention only through the backend's `prepare_for_capture`: the
backend's kernels read the static buffers, so a replay needs no metadata work."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.executor.forward_batch import ForwardBatch, Span, ancestor_bits, device_batch
from engine.executor.graph_capture import capture_graphs
from engine.executor.graph_inputs import (
    IDS,
    LAST,
    NUM_ROWS,
    POSITIONS,
    Q_LENS,
    Q_STARTS,
    ROWS,
    SEQ_LENS,
    SLOTS,
    TREE_BITS,
    bucket_for,
    padded_columns,
    uniform_columns,
)
from engine.executor.host_copy import PinnedMirror
from engine.executor.prompt_embeds import InputEmbeds, concat_input_embeds
from engine.kernels import triton_usable
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)


GraphOutputs = tuple[torch.Tensor, ...]


class CudaGraphs:
    """`load` a batch into the static buffers, then `replay` it. `run` is the eager forward
    that was captured: (ForwardBatch, per-token hidden input or None) -> tensors whose first
    dimension is the batch's tokens, then `request_outputs` tensors whose first dimension is
    the batch's request columns (one row per request, read at `ForwardBatch.last_index`, or
    per span of a uniform load: engine.sampling.verify_outputs).
    `buckets` are the token counts captured; a graph of T tokens holds up to T requests of at
    most `max_span` tokens each. With `hidden_width`, each token also brings a hidden state of
    that width (a draft depth's input). With `embeds_width`, a token may come as a vector of
    that width in place of its id's embedding (prompt_embeds): the graph always reads the
    vectors and a mask, all False where no span gave any. With `trees`, spans may be token
    trees (`Span.positions`, `Span.visible`): the graphs read each token's mask, which costs
    attention a load and a shift per key block, so only graphs that run trees take it."""

    def __init__(
        self,
        name: str,
        run: Callable[[ForwardBatch, torch.Tensor | None], GraphOutputs],
        attention: AttentionBackend,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        buckets: list[int],
        max_span: int,
        hidden_width: int | None = None,
        request_outputs: int = 0,
        embeds_width: int | None = None,
        trees: bool = False,
    ) -> None:
        if not attention.supports_cuda_graph:
            raise ValueError(f"{type(attention).__name__} cannot be captured in a CUDA graph")
        self.name = name
        self.run = run
        self.attention = attention
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.buckets = buckets
        self.max_span = max_span
        self.request_outputs = request_outputs
        self.capacity = max(buckets)
        self.trees = trees
        device = kv_pool.device
        num_rows = NUM_ROWS + (1 if trees else 0)
        self.inputs = torch.zeros((num_rows, self.capacity), dtype=torch.int64, device=device)
        self.staged = PinnedMirror(self.inputs)  # filled from lists every step
        self.hidden: torch.Tensor | None = None
        if hidden_width is not None:
            self.hidden = torch.zeros(
                (self.capacity, hidden_width), dtype=kv_pool.dtype, device=device
            )
        self.embeds: torch.Tensor | None = None
        self.embeds_mask: torch.Tensor | None = None
        if embeds_width is not None:
            self.embeds = torch.zeros(
                (self.capacity, embeds_width), dtype=kv_pool.dtype, device=device
            )
            self.embeds_mask = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        # Whether the batch loaded last gave vectors for some of its tokens.
        self.loaded_embeds = False
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # What every graph's outputs are copied into, sized for the largest.
        self._outputs: GraphOutputs = ()
        self.num_replays = 0

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(self.buckets, num_tokens)

    def fits(self, spans: list[Span]) -> bool:
        """Whether a captured graph runs these spans: token trees only in graphs of trees."""
        num_tokens = sum(len(span.token_ids) for span in spans)
        return (
            bool(spans)
            and self.bucket_for(num_tokens) is not None
            and all(
                0 < len(span.token_ids) <= self.max_span
                and (span.input_embeds is None or self.embeds is not None)
                and (self.trees or (span.visible is None and span.positions is None))
                for span in spans
            )
        )

    def capture(self, progress: bool = True) -> None:
        """Capture every bucket (engine.executor.graph_capture). Each graph ends by copying its
        outputs into buffers shared by all sizes (allocated outside the pool), so no graph keeps
        memory of its own once captured: the pool holds one graph's intermediates at a time,
        whatever the number of sizes."""
        device = self.kv_pool.device
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(device)
        label = f"capturing {self.name} CUDA graphs" if progress else None
        captured = capture_graphs(self.buckets, device, self._load_static, label)
        self.graphs = {size: graph for size, (graph, _) in captured.items()}
        used = torch.cuda.memory_allocated(device) - before
        logger.info(
            "captured %d %s CUDA graphs (%s tokens) in %.1f s, %.0f MiB",
            len(captured),
            self.name,
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
            used / 2**20,
        )

    def _load_static(self, size: int) -> Callable[[], GraphOutputs]:
        """The graph of `size`'s inputs, every token a padding request of its own, and its
        forward: the captured one copies its outputs into the shared buffers, sized by the
        first forward run (the largest size's, outside any capture)."""
        self._fill(size, [])
        self.staged.upload()
        batch = self._static_batch(size)
        hidden = None if self.hidden is None else self.hidden[:size]

        def forward() -> GraphOutputs:
            outputs = self.run(batch, hidden)
            if not self._outputs:
                self._outputs = tuple(torch.empty_like(out) for out in outputs)
            for shared, out in zip(self._outputs, outputs):
                shared[: len(out)].copy_(out)
            return self._outputs

        return forward

    def load(self, spans: list[Span], hidden: torch.Tensor | None = None) -> ForwardBatch:
        """A batch of these spans (`fits` must hold), written into the static buffers with its
        padding: one copy from the host, and one on the device of `hidden` [tokens, width] when
        the graphs take a hidden input (padded tokens read what the buffer holds: their
        outputs are dropped)."""
        num_tokens = sum(len(span.token_ids) for span in spans)
        size = self.bucket_for(num_tokens)
        assert size is not None, f"{num_tokens} tokens above the largest {self.name} graph"
        self._fill(size, spans)
        self.staged.upload()
        if self.hidden is not None:
            assert hidden is not None and hidden.shape[0] == num_tokens
            self.hidden[:num_tokens].copy_(hidden)
        if self.embeds is not None:
            self._load_embeds(size, spans, num_tokens)
        return self._batch(
            size,
            [span.start + len(span.token_ids) for span in spans],
            [len(span.token_ids) for span in spans],
        )

    def load_uniform(
        self, rows: np.ndarray, starts: np.ndarray, tokens: np.ndarray, slots: np.ndarray
    ) -> ForwardBatch:
        """`load` of causal spans that all bring the same number of tokens, given as arrays
        (`uniform_columns`), none as vectors; `fits_uniform` must hold."""
        n, width = tokens.shape
        size = self.bucket_for(n * width)
        assert size is not None and self.embeds is None
        staged = self.staged.writable()
        staged[:NUM_ROWS, :size] = uniform_columns(
            size, rows, starts, tokens, slots, self.req_to_token_pool.padding_row
        )
        if self.trees:
            staged[TREE_BITS, :size] = -1  # every span causal
        self.staged.upload()
        return self._batch(size, (starts + width).tolist(), [width] * n)

    def advance_uniform(
        self, batch: ForwardBatch, kept: torch.Tensor, candidates: torch.Tensor, rest: torch.Tensor
    ) -> None:
        """Move each span of `batch` (made by `load_uniform`; its graph replayed since, or
        not) past its first kept[i] + 1 tokens, bringing candidates[i, kept[i]] ([n, width])
        then rest[i] ([n, width - 1]): a speculative verify's spans moved past the accepted
        drafts and the target's token after them, bringing that token and the next drafts.
        All on the device, each span's KV slots read from the row table there, so the same
        requests' next forward is queued before the host has seen how far this one moved
        them. Every position of the moved spans must have its slot in the row table."""
        n, width = candidates.shape
        assert batch.graph is self and batch.num_tokens == n * width
        table = self.req_to_token_pool.req_to_token
        if triton_usable(self.inputs):
            from engine.kernels.spans import advance_spans

            advance_spans(self.inputs, kept, candidates, rest, table, 3 + ROWS, 3 + SEQ_LENS)
            return
        used = n * width
        positions = self.inputs[POSITIONS, :used].view(n, width)
        positions += (kept + 1)[:, None]
        head = candidates.gather(1, kept[:, None])
        self.inputs[IDS, :used].view(n, width).copy_(torch.cat([head, rest], dim=1))
        rows = self.inputs[3 + ROWS, :n]
        self.inputs[SLOTS, :used].view(n, width).copy_(table[rows[:, None], positions])
        self.inputs[3 + SEQ_LENS, :n] += kept + 1

    def advance_trees(
        self,
        batch: ForwardBatch,
        kept: torch.Tensor,
        candidates: torch.Tensor,
        nodes: torch.Tensor,
        depth: int,
    ) -> None:
        """`advance_uniform` for spans of token trees (a graph set of trees, spans of one
        width loaded by `load`): each span's root moves past kept[i] + 1 positions and brings
        candidates[i, kept[i]]; its nodes are those of `nodes` [n, 3 * count] (tokens, parents
        with -1 for the root, levels: spec.runtime.device_tree's, in any number type), node j at
        cache position root + 1 + j and rotary position root + its level, seeing itself, the root
        and its ancestors (at most `depth` levels above it). A round's next tree verify, queued
        before the host has read the trees."""
        n = candidates.shape[0]
        count = nodes.shape[1] // 3
        width = count + 1
        assert self.trees and batch.graph is self and batch.num_tokens == n * width
        table = self.req_to_token_pool.req_to_token
        if triton_usable(self.inputs):
            from engine.kernels.spans import advance_tree_spans

            advance_tree_spans(
                self.inputs, kept, candidates, nodes, depth, table,
                3 + ROWS, 3 + SEQ_LENS, TREE_BITS,
            )  # fmt: skip
            return
        used = n * width
        tokens, parents, levels = nodes.to(torch.int64).reshape(n, 3, count).unbind(1)
        positions = self.inputs[POSITIONS, :used].view(n, width)
        root = positions[:, :1] + (kept + 1)[:, None]
        head = candidates.gather(1, kept[:, None])
        self.inputs[IDS, :used].view(n, width).copy_(torch.cat([head, tokens], dim=1))
        rows = self.inputs[3 + ROWS, :n]
        cache = root + torch.arange(width, device=root.device)
        self.inputs[SLOTS, :used].view(n, width).copy_(table[rows[:, None], cache])
        positions.copy_(torch.cat([root, root + levels], dim=1))
        self.inputs[3 + SEQ_LENS, :n] = root[:, 0] + width
        self.inputs[TREE_BITS, :used].view(n, width).copy_(ancestor_bits(parents, depth))

    def fits_uniform(self, num_requests: int, width: int) -> bool:
        """Whether `load_uniform` takes `num_requests` spans of `width` tokens."""
        return (
            num_requests > 0
            and 0 < width <= self.max_span
            and self.embeds is None
            and self.bucket_for(num_requests * width) is not None
        )

    def _load_embeds(self, size: int, spans: list[Span], num_tokens: int) -> None:
        assert self.embeds is not None and self.embeds_mask is not None
        values, mask = concat_input_embeds(
            [span.input_embeds for span in spans],
            [len(span.token_ids) for span in spans],
            self.embeds.device,
            self.embeds.dtype,
        )
        self.loaded_embeds = values is not None
        if values is None:
            self.embeds_mask[:size].fill_(False)
            return
        self.embeds[:num_tokens].copy_(values)
        self.embeds_mask[:num_tokens].copy_(mask)
        self.embeds_mask[num_tokens:size].fill_(False)

    def embeds_used(self, num_tokens: int) -> InputEmbeds | None:
        """The vectors the batch loaded last read in place of token embeddings, out of the
        graph's buffers (the next load overwrites them) and sliced to its real tokens."""
        if not self.loaded_embeds:
            return None
        assert self.embeds is not None and self.embeds_mask is not None
        return InputEmbeds(self.embeds[:num_tokens].clone(), self.embeds_mask[:num_tokens].clone())

    def replay(self, batch: ForwardBatch) -> GraphOutputs:
        """The captured forward's outputs for `batch` (made by `load`), sliced to its tokens
        (or its requests). They are views of the graph's buffers: valid until the next replay."""
        size = batch.graph_batch_size
        assert batch.graph is self and size in self.graphs
        self.graphs[size].replay()
        self.num_replays += 1
        per_token = len(self._outputs) - self.request_outputs
        return tuple(
            out[: batch.num_tokens if i < per_token else batch.batch_size]
            for i, out in enumerate(self._outputs)
        )

    def _fill(self, size: int, spans: list[Span]) -> None:
        columns = padded_columns(size, spans, self.req_to_token_pool.padding_row, self.trees)
        self.staged.writable()[:, :size] = columns

    def _static_batch(self, size: int) -> ForwardBatch:
        """The batch captured for `size`: every column, its metadata over the static buffers."""
        batch = self._batch(size, [1] * size, [1] * size)
        reqs = self.inputs[3:, :size]
        # No span in a graph of `size` tokens is longer than that.
        max_span = min(self.max_span, size)
        tree = self.inputs[TREE_BITS, :size] if self.trees else None
        batch.attn_metadata = self.attention.prepare_for_capture(
            reqs[ROWS], reqs[SEQ_LENS], reqs[Q_STARTS], reqs[Q_LENS], max_span, tree
        )
        return batch

    def _batch(self, size: int, seq_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        """A batch over the first columns of the static buffers: sum(extend_lens) tokens of
        len(seq_lens) requests, in the graph of `size`."""
        num_tokens = sum(extend_lens)
        tokens = self.inputs[:3, :num_tokens]
        embeds = None if self.embeds is None else self.embeds[:num_tokens]
        embeds_mask = None if self.embeds_mask is None else self.embeds_mask[:num_tokens]
        return device_batch(
            tokens[IDS],
            tokens[POSITIONS],
            tokens[SLOTS],
            self.inputs[3 + ROWS, : len(seq_lens)],
            seq_lens,
            extend_lens,
            (self.kv_pool, self.req_to_token_pool),
            input_embeds=embeds,
            input_embeds_mask=embeds_mask,
            last_index=self.inputs[3 + LAST, : len(seq_lens)],
            tree_bits=self.inputs[TREE_BITS, :num_tokens] if self.trees else None,
            graph=self,
            graph_batch_size=size,
        )
