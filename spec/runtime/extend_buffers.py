"""The inputs the decode step's fixed-shape draft extend (spec.runtime.decode_extend) reads for one
batch size, on the device, with the host mirror it fills them from."""

from __future__ import annotations

import numpy as np
import torch

from engine.executor.host_copy import PinnedMirror


class ExtendBuffers:
    """The inputs one batch size reads, on the device: one int64 block filled by one copy from a
    pinned host mirror (per depth its tokens and positions, then per request its row, cache
    length, first token, token count; then the verdicts, below), the verify's hidden states
    and the boundary states. Each depth's KV slots are read from its row table on the device,
    rows and positions being known there. The verdicts (per request the verify's K+1
    targets, then its accepted count) come last: the host writes them into the mirror, or a
    round on the device copies them over it, and the forward copies the committed tokens
    into each depth's."""

    def __init__(
        self,
        size: int,
        k: int,
        widths: list[int],
        padding_rows: list[int],
        fork_rows: list[int],
        in_width: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        self.layout: list[tuple[int, int]] = []  # per depth: (offset, tokens)
        offset = 0
        for width in widths:
            tokens = size * width
            self.layout.append((offset, tokens))
            offset += 2 * tokens + 4 * size
        self.length = offset + size * (k + 2)
        self.ints = torch.zeros(self.length, dtype=torch.int64, device=device)
        self.staged = PinnedMirror(self.ints)
        self.verdicts = self.ints[offset:].view(size, k + 2)
        self.accepted = self.verdicts[:, k + 1]
        self.host_verdicts = self.staged.array[offset:].reshape(size, k + 2)
        # Every request a padding one: token 0 from position 0 over the padding row.
        self.padding = np.zeros(self.length, dtype=np.int64)
        for (offset, tokens), width, row in zip(self.layout, widths, padding_rows):
            block = self.padding[offset : offset + 2 * tokens + 4 * size]
            block[tokens : 2 * tokens] = np.tile(np.arange(width), size)
            block[2 * tokens :] = np.concatenate(
                [np.full(size, row), np.full(size, width), np.arange(size) * width,
                 np.full(size, width)]
            )  # fmt: skip
        # The host mirror's views of each depth, kept: a fill writes through them.
        self.host = [self.host_views(d, width) for d, width in enumerate(widths)]
        self.columns = [np.arange(width) for width in widths]
        self.verify_hidden = torch.zeros((size, k + 1, in_width), dtype=dtype, device=device)
        self.boundary = torch.zeros((max(k - 1, 1), size, hidden), dtype=dtype, device=device)
        # The device views a fill writes through, kept: each slicing is a call into torch that
        # costs microseconds of host time, every step.
        self.ids = [self.depth_views(d)[0].view(size, width) for d, width in enumerate(widths)]
        self.positions = [
            self.depth_views(d)[1].view(size, width) for d, width in enumerate(widths)
        ]
        # Constants the forward would otherwise make each replay, a kernel each.
        self.every = torch.arange(size, device=device)
        self.steps = torch.arange(k, device=device)
        # Each depth's span: its cache positions, from the first one (a request's start).
        self.cache_columns = [torch.arange(width, device=device) for width in widths]
        # Per depth with forks (a tree), each token's visibility bits: the main rows causal
        # (-1), the fork rows' filled on the device each step (spec/runtime/device_tree.py).
        self.bits = [
            torch.full((size, width), -1, dtype=torch.int64, device=device) if forks else None
            for width, forks in zip(widths, fork_rows)
        ]

    def depth_views(self, d: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, rows, seq_lens, q_starts, q_lens) of depth d."""
        offset, tokens = self.layout[d]
        token_rows = self.ints[offset : offset + 2 * tokens].view(2, tokens)
        request_rows = self.ints[offset + 2 * tokens : offset + 2 * tokens + 4 * self.size]
        request_rows = request_rows.view(4, self.size)
        return (*token_rows, *request_rows)

    def host_views(self, d: int, width: int) -> tuple[np.ndarray, ...]:
        """The host mirror's (ids [size, width], positions [size, width], rows, seq_lens),
        written after `staged.writable`."""
        offset, tokens = self.layout[d]
        values = self.staged.array
        ids, positions = values[offset : offset + 2 * tokens].reshape(2, self.size, width)
        request_rows = values[offset + 2 * tokens : offset + 2 * tokens + 2 * self.size]
        rows, seq_lens = request_rows.reshape(2, self.size)
        return ids, positions, rows, seq_lens
