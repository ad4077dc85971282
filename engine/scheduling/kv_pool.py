"""Paged KV storage (page size 1): per-layer K and V indexed by slot, and request rows of slots.

Invariants:
- `KVPool` holds `capacity + 1` slots per layer; slot 0 is the padding slot (see
  engine.scheduling.allocator), so padded positions may write there and nobody reads it as real
  data;
- `ReqToTokenPool.req_to_token[row, i]` is the slot holding token i of the request in `row`, for
  every i below the request's computed length; rows are handed out and returned whole. One more
  row, `padding_row`, is never handed out and holds only the padding slot: padded rows of a
  CUDA graph's batch read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from engine.executor.host_copy import int_tensor
from engine.scheduling.allocator import SlotAllocator


class KVPool:
    """K and V caches of every layer, shape [capacity + 1, num_kv_heads, head_dim] each, all views
    into `kv_buffer` [capacity + 1, num_layers, 2, num_kv_heads, head_dim]."""

    layout = "slot, layer, k/v, head, dim"

    def __init__(
        self,
        capacity: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.capacity = capacity
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Slot-major: one slot's K and V of every layer are contiguous, so a request's KV is
        # gathered for a transfer (and scattered on arrival) by one indexing op over large rows.
        # The per-layer lists are strided views into it.
        self.kv_buffer = torch.zeros(
            (capacity + 1, num_layers, 2, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.k_buffers = [self.kv_buffer[:, layer, 0] for layer in range(num_layers)]
        self.v_buffers = [self.kv_buffer[:, layer, 1] for layer in range(num_layers)]
        self.allocator = SlotAllocator(capacity)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer][slots] = k
        self.v_buffers[layer][slots] = v

    def move_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Slot target[i] gets the K and V of every layer that slot source[i] holds, on the
        device, in one gather and one scatter: every source is read before any target is
        written, so a slot both read and written gives what it held before. A target appears
        once, but for the padding slot, which any number of pairs may write (nobody reads it):
        a caller moves fewer slots for some requests than for others without a branch."""
        self.kv_buffer[target] = self.kv_buffer[source]


class ReqToTokenPool:
    """Maps a request row to the KV slots of its tokens, shape [max_reqs + 1, max_context_len]
    (the last row being the padding row)."""

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.padding_row = max_reqs
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context_len), dtype=torch.int64, device=device
        )
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def allocate_row(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request row")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.max_reqs:
            raise ValueError(f"request row {row} freed but not allocated")
        self._free_rows.append(row)

    def copy_prefixes(self, pairs: list[tuple[int, int]], length: int) -> None:
        """Each (source, destination) row pair: the destination's first `length` entries become
        the source's, one indexed copy for all of them. A destination row then reads the
        source's cached tokens there without holding their slots (speculative decoding's
        alternative draft chains)."""
        if not pairs or length <= 0:
            return
        index = int_tensor(pairs, self.req_to_token.device).T
        self.req_to_token[index[1], :length] = self.req_to_token[index[0], :length]

    def write(self, row: int, start: int, slots: list[int]) -> None:
        self.write_many([(row, start, slots)])

    def write_many(self, entries: list[tuple[int, int, list[int]]]) -> None:
        """Each (row, start, slots): slots for tokens start.. of that row. One indexed write for
        all of them: on a GPU every tensor made from a Python list is a copy to the device, and
        a decode step grows every running request."""
        entries = [entry for entry in entries if entry[2]]
        if not entries:
            return
        if len(entries) == 1:
            row, start, slots = entries[0]
            values = int_tensor(slots, self.req_to_token.device)
            self.req_to_token[row, start : start + len(slots)] = values
            return
        rows, starts, slots = zip(*entries)
        flat = [slot for run in slots for slot in run]
        self.write_runs(list(rows), list(starts), [len(run) for run in slots], flat)

    def write_runs(
        self,
        rows: list[int],
        starts: list[int],
        counts: list[int],
        slots: Sequence[int] | np.ndarray,
    ) -> None:
        """Row rows[i] gets the next counts[i] of `slots` for its tokens starts[i]..: the
        entries of `write_many`, already concatenated, in one indexed write."""
        lengths = np.array(counts, dtype=np.int64)
        total = int(lengths.sum())
        if not total:
            return
        # Each slot's column: its run's start, plus its place in the run.
        run_of = np.repeat(np.arange(len(counts)), lengths)
        first = np.cumsum(lengths) - lengths  # where each run begins among the slots
        cols = np.asarray(starts, dtype=np.int64)[run_of] + np.arange(total) - first[run_of]
        index = np.stack([np.asarray(rows, dtype=np.int64)[run_of], cols, np.asarray(slots)])
        index = int_tensor(index, self.req_to_token.device)
        self.req_to_token[index[0], index[1]] = index[2]


class SlotHolder(Protocol):
    """What holds KV slots in a pool: a request of the target, or a draft depth's sequence."""

    row: int | None
    slots: list[int]


def grow_holders(
    kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, grants: list[tuple[SlotHolder, int]]
) -> None:
    """Give each holder `num_slots` more slots (taking a row first if it has none): one
    allocation for all of them, in grant order, and one write to the row table. No slot is
    taken when they do not all fit."""
    if not grants:
        return
    for holder, _ in grants:
        if holder.row is None:
            holder.row = req_to_token_pool.allocate_row()
    slots = kv_pool.allocator.allocate(sum(n for _, n in grants))
    rows, starts, counts = [], [], []
    taken = 0
    for holder, n in grants:
        if n:
            rows.append(holder.row)
            starts.append(len(holder.slots))
            counts.append(n)
            holder.slots.extend(slots[taken : taken + n])
            taken += n
    if not slots:
        return
    # The allocator hands slots out ascending: ends that far apart are one run, made into an
    # array from its ends rather than slot by slot.
    first, last = slots[0], slots[-1]
    whole_run = last - first == len(slots) - 1
    values = np.arange(first, last + 1, dtype=np.int64) if whole_run else slots
    req_to_token_pool.write_runs(rows, starts, counts, values)
