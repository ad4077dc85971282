"""Integer lists to the device without stalling it.

A copy from pageable host memory to a GPU is staged by the driver synchronously: the host
waits for every kernel already queued before the copy starts. A step that sends a few index
lists to the device (row-table writes, slot lists, the tokens a draft reads) would wait for
the device each time and lose all overlap of host and device work. Staged through pinned
memory, the copy is queued like a kernel; PyTorch's pinned-memory cache keeps each staging
block until the copy reading it has run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def int_tensor(
    values: Sequence[int] | Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """`values` (a list of ints, or equal-length lists of them) as an int64 tensor on `device`,
    queued behind the work already on its stream. Through numpy: several times faster than
    torch.tensor on Python ints."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, queued like `int_tensor` (no wait for the device)."""
    if torch.device(device).type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def recorded_event(device: torch.device) -> torch.cuda.Event:
    """An event behind the work queued so far on `device`'s current stream. Given the device,
    the stream lookup skips the several Python calls (about 8 us of host time) that
    `Event.record()` makes to find the current device, each of a round's few copies."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class HostCopy:
    """A device tensor's copy to the host, queued behind the work already on its stream:
    `tolist` waits for that copy alone, not for work queued after it."""

    def __init__(self, values: torch.Tensor) -> None:
        on_gpu = values.is_cuda
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=on_gpu)
        self.host.copy_(values, non_blocking=on_gpu)
        self.copied = recorded_event(values.device) if on_gpu else None

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def tolist(self) -> list:
        self.wait()
        return self.host.tolist()


class PinnedMirror:
    """A device tensor of integers filled from a pinned host copy of it, one whole-buffer copy
    a fill (a slice would be strided, and a strided copy from the host waits for the device):
    `writable` hands out the host array once the last copy from it has read it, `upload`
    queues the copy."""

    def __init__(self, device_tensor: torch.Tensor) -> None:
        self.device_tensor = device_tensor
        self.host = torch.zeros(
            device_tensor.shape, dtype=device_tensor.dtype, pin_memory=device_tensor.is_cuda
        )
        # The same memory as an array: numpy converts lists of ints several times faster than
        # torch.tensor.
        self.array = self.host.numpy()
        self._copied: torch.cuda.Event | None = None

    def writable(self) -> np.ndarray:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.array

    def upload(self) -> None:
        self.device_tensor.copy_(self.host, non_blocking=True)
        if self.device_tensor.is_cuda:
            self._copied = recorded_event(self.device_tensor.device)
