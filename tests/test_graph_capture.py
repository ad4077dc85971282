"""The capture recipe every CUDA graph shares (engine.executor.graph_capture) and the attention
backend's capture hook (AttentionBackend.prepare_for_capture): on a GPU, every size captured,
largest first, each replay reading the inputs its `load` filled; everywhere, the collector
paused only while capturing, and a backend that cannot be captured refusing the hook."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.attention import create_attention_backend
from engine.executor.cuda_graph import CudaGraphs
from engine.executor.graph_capture import capture_graphs, collection_paused
from engine.kernels import triton_runs_on
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool


def test_collection_is_paused_only_while_capturing() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"), collection_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_backend_that_cannot_be_captured_refuses_the_capture_hook() -> None:
    backend = create_attention_backend("torch", 2, 1, 4)
    assert not backend.supports_cuda_graph
    columns = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="TorchAttentionBackend cannot be captured"):
        backend.prepare_for_capture(columns, columns, columns, columns, 1)
    pools = KVPool(8, 1, 1, 4, torch.float32, "cpu"), ReqToTokenPool(2, 8, "cpu")
    with pytest.raises(ValueError, match="TorchAttentionBackend cannot be captured"):
        CudaGraphs("decode", lambda batch, hidden: (), backend, *pools, [1], 1)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_every_size_is_captured_largest_first_and_replays_its_inputs() -> None:
    device = torch.device("cuda")
    inputs = torch.zeros(8, device=device)
    loaded = []

    def load(size: int):
        loaded.append(size)
        inputs[:size] = -1.0  # the padding a capture runs over
        view = inputs[:size]
        return lambda: view * 2 + 1

    captured = capture_graphs([1, 4, 8, 2], device, load)
    assert loaded == [8, 4, 2, 1] and sorted(captured) == [1, 2, 4, 8]
    assert gc.isenabled()
    for size, (graph, out) in captured.items():
        inputs.copy_(torch.arange(8.0, device=device) + size)
        graph.replay()
        torch.cuda.synchronize(device)
        expected = (torch.arange(size, device=device) + size) * 2 + 1
        assert torch.equal(out, expected.float())


@pytest.mark.gpu
@pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton")
def test_a_capturable_backends_metadata_reads_the_runners_buffers() -> None:
    backend = create_attention_backend("triton", 2, 1, 16)
    assert backend.supports_cuda_graph
    columns = torch.zeros((4, 3), dtype=torch.int64, device="cuda")
    meta = backend.prepare_for_capture(*columns, 2)
    assert [t.data_ptr() for t in (meta.rows, meta.seq_lens, meta.q_starts, meta.q_lens)] == [
        c.data_ptr() for c in columns
    ]
