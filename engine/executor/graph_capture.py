"""The one recipe by which every CUDA graph here is captured: the engine's graph sets
(engine.executor.cuda_graph) and the speculator's fixed-shape draft extend alike.

Per size, largest first: the caller fills that size's inputs, the forward runs once on a side
stream outside any capture (compiling kernels, setting up cuBLAS), then is captured on that
stream into one memory pool shared by every size, with Python's cyclic collector paused."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

Outputs = TypeVar("Outputs")


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector kept from running while graphs are captured: a
    collection then may free another engine's graphs or the tensors in their pools, and a
    CUDA call of theirs in the middle of a capture invalidates it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@torch.inference_mode()  # as every forward: the kernels' fast paths need no autograd
def capture_graphs(
    sizes: list[int],
    device: torch.device,
    load: Callable[[int], Callable[[], Outputs]],
    progress: str | None = None,
) -> dict[int, tuple[torch.cuda.CUDAGraph, Outputs]]:
    """A graph per size, largest first, sharing one memory pool: `load(size)` fills the
    inputs that size's graph reads (on the current stream: they land before the forward runs)
    and returns the forward to capture, which reads only those. Returns each size's graph and
    what its captured forward returned (tensors its replays write). `progress`: the label of a
    progress bar over the sizes, None for none."""
    from tqdm import tqdm

    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    captured: dict[int, tuple[torch.cuda.CUDAGraph, Outputs]] = {}
    pool = None
    with collection_paused():
        ordered = sorted(sizes, reverse=True)
        for size in tqdm(ordered, desc=progress, disable=progress is None, leave=False):
            forward = load(size)
            stream.wait_stream(current)  # the inputs' copy lands first
            with torch.cuda.stream(stream):
                forward()  # compiles the kernels and sets up cuBLAS outside the capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = forward()
            pool = graph.pool()
            captured[size] = (graph, outputs)
    current.wait_stream(stream)
    torch.cuda.synchronize(device)
    return captured
