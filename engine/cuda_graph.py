"""Decode forwards captured as CUDA graphs, one per batch-size bucket, and replayed with the
batch padded to its bucket: a replay costs one launch where the eager forward costs one host
dispatch per kernel (about ten a layer).

The graphs read their inputs from one static [5, max_bs] buffer (token ids, positions, KV slots,
request rows, sequence lengths), filled by one host-to-device copy per step. Padded rows read
token 0 at position 0, write their K and V to the padding slot (slot 0, which no request owns)
and read the padding row of the request table, so they never touch a request's KV; their
outputs are sliced off before anything (sampling, statistics, a transfer) sees them.

The graph runner touches attention only through the backend's `prepare_for_capture`: the
backend's kernels read the static buffers, so a replay needs no metadata work."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.attention import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kv_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

# Rows of the static input buffer.
_IDS, _POSITIONS, _SLOTS, _ROWS, _SEQ_LENS = range(5)
PADDING_SLOT = 0


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, every 8 to 64, every 16 to 256, every 32 beyond,
    and `max_batch_size` itself, none above it."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16)]
    sizes += range(288, max_batch_size + 1, 32)
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


def bucket_for(buckets: list[int], batch_size: int) -> int | None:
    """The smallest bucket that holds `batch_size`, or None above the largest."""
    for size in buckets:
        if size >= batch_size:
            return size
    return None


DecodeOutputs = tuple[torch.Tensor, ...]


class DecodeGraphs:
    """`load` a decode batch into the static buffers, then `replay` it. `run` is the eager
    forward that was captured: ForwardBatch -> tensors whose first dimension is the batch."""

    def __init__(
        self,
        run: Callable[[ForwardBatch], DecodeOutputs],
        attention: AttentionBackend,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        max_batch_size: int,
    ) -> None:
        if not attention.supports_cuda_graph:
            raise ValueError(f"{type(attention).__name__} cannot be captured in a CUDA graph")
        self.run = run
        self.attention = attention
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.buckets = batch_size_buckets(max_batch_size)
        device = kv_pool.device
        self.inputs = torch.zeros((5, max_batch_size), dtype=torch.int64, device=device)
        self.host = torch.zeros((5, max_batch_size), dtype=torch.int64, pin_memory=True)
        self.q_starts = torch.arange(max_batch_size, dtype=torch.int64, device=device)
        self.q_lens = torch.ones(max_batch_size, dtype=torch.int64, device=device)
        self.padding = torch.tensor(
            [0, 0, PADDING_SLOT, req_to_token_pool.padding_row, 1], dtype=torch.int64
        )
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeOutputs] = {}
        self.capture_seconds = 0.0

    def bucket_for(self, batch_size: int) -> int | None:
        return bucket_for(self.buckets, batch_size)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every bucket, largest first, into one memory pool: only one graph's
        intermediates are alive at a time, so they can share it."""
        from tqdm import tqdm

        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.kv_pool.device)
        self.inputs.copy_(self.padding[:, None].expand_as(self.inputs))
        stream = torch.cuda.Stream(self.kv_pool.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv_pool.device))
        pool = None
        sizes = sorted(self.buckets, reverse=True)
        for size in tqdm(sizes, desc="capturing CUDA graphs", disable=not progress, leave=False):
            batch = self._static_batch(size)
            with torch.cuda.stream(stream):
                self.run(batch)  # compiles the kernels and sets up cuBLAS outside the capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[size] = self.run(batch)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.current_stream(self.kv_pool.device).wait_stream(stream)
        torch.cuda.synchronize(self.kv_pool.device)
        self.capture_seconds = time.perf_counter() - start
        used = torch.cuda.memory_allocated(self.kv_pool.device) - before
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(sizes),
            ",".join(map(str, self.buckets)),
            self.capture_seconds,
            used / 2**20,
        )

    def load(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        rows: list[int],
        seq_lens: list[int],
    ) -> ForwardBatch:
        """A decode batch of len(input_ids) requests, written into the static buffers with its
        padding rows: one copy to the device."""
        num_reqs = len(input_ids)
        size = self.bucket_for(num_reqs)
        assert size is not None, f"batch of {num_reqs} above the largest graph"
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host buffer
        host = self.host[:, :size]
        host[:, :num_reqs] = torch.tensor([input_ids, positions, slots, rows, seq_lens])
        host[:, num_reqs:] = self.padding[:, None]
        self.inputs[:, :size].copy_(host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        inputs = self.inputs[:, :num_reqs]
        return ForwardBatch(
            input_ids=inputs[_IDS],
            positions=inputs[_POSITIONS],
            out_cache_loc=inputs[_SLOTS],
            req_pool_indices=inputs[_ROWS],
            seq_lens=list(seq_lens),
            extend_lens=[1] * num_reqs,
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token_pool,
            graph_batch_size=size,
        )

    def replay(self, batch: ForwardBatch) -> DecodeOutputs:
        """The captured forward's outputs for `batch` (made by `load`), sliced to its requests.
        They are views of the graph's buffers: valid until the next replay."""
        size = batch.graph_batch_size
        assert size is not None and size in self.graphs
        self.graphs[size].replay()
        return tuple(out[: batch.batch_size] for out in self.outputs[size])

    def _static_batch(self, size: int) -> ForwardBatch:
        inputs = self.inputs[:, :size]
        batch = ForwardBatch(
            input_ids=inputs[_IDS],
            positions=inputs[_POSITIONS],
            out_cache_loc=inputs[_SLOTS],
            req_pool_indices=inputs[_ROWS],
            seq_lens=[1] * size,
            extend_lens=[1] * size,
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token_pool,
            graph_batch_size=size,
        )
        batch.attn_metadata = self.attention.prepare_for_capture(
            inputs[_ROWS], inputs[_SEQ_LENS], self.q_starts[:size], self.q_lens[:size], 1
        )
        return batch
