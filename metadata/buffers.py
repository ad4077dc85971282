"""MetadataBuffers: the per-request state that crosses from prefill to decode besides the KV.

One preallocated row per in-flight request, allocated on both sides (the prefill node writes its
row and sends it; the decode node receives into its own row). Every field of every row lives in
ONE byte tensor (`storage`, [num_rows, row_nbytes]) and each field is a typed view onto it, so a
row is one contiguous slice (`row_bytes`): a transfer sends it as one message straight from the
row, and the receiver lands it with one copy instead of one per field.

Invariants (tested in tests/test_metadata_buffers.py):
- `room[row]` is written last by `write_row`, and room is the row's last field: a row whose room
  tag equals the expected room has every other field in place: `row_landed(row, room)`. The
  receiver lands a whole row by one copy and checks the tag only once that copy completed;
- a free row has room tag 0 (`free` zeroes it, as `void` does for a row that is sent without
  its request's state) and rooms are never 0, so a stale or void row never passes for a landed
  one;
- `hidden_states` is `spec_hidden_size` wide, never `hidden_size`: a model that widens its
  residual stream (hc_mult > 1) or concatenates auxiliary hidden states hands the draft more
  than `hidden_size` values per token;
- `row_tensors(row)` lists the row's fields in `FIELDS` order with room last: the order in which
  they lie in `row_bytes(row)`, and so on the wire.
"""

from __future__ import annotations

import math

import torch

FIELDS = (
    "output_ids",
    "output_logprob",
    "topk_index",
    "topk_p",
    "hidden_states",
    "boundary_hidden",
    "cached_tokens",
    "room",
)

# Every field starts on this boundary, and every row is a multiple of it long, so that each field
# of every row can be viewed in its own dtype (int64 needs 8-byte alignment).
_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class MetadataBuffers:
    def __init__(
        self,
        num_rows: int,
        spec_hidden_size: int,
        num_draft_steps: int,
        topk: int,
        hidden_dtype: torch.dtype,
        device: str | torch.device,
        boundary_width: int = 0,
    ) -> None:
        """`boundary_width`: the width of a draft depth's output (the target's hidden_size):
        depth d's output at the last prompt position its inputs fully cover, for d < K-1,
        which the decode side's first draft extend starts from."""
        if num_rows < 1:
            raise ValueError(f"MetadataBuffers needs at least one row, got num_rows={num_rows}")
        self.num_rows = num_rows
        self.spec_hidden_size = spec_hidden_size
        self.num_draft_steps = num_draft_steps
        self.topk = topk
        self.hidden_dtype = hidden_dtype
        self.device = torch.device(device)
        width = num_draft_steps * topk
        depths_with_boundary = max(num_draft_steps - 1, 0)
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "output_ids": ((), torch.int64),
            "output_logprob": ((), torch.float32),
            "topk_index": ((width,), torch.int64),
            "topk_p": ((width,), torch.float32),
            "hidden_states": ((spec_hidden_size,), hidden_dtype),
            "boundary_hidden": ((depths_with_boundary, boundary_width), hidden_dtype),
            "cached_tokens": ((), torch.int64),
            "room": ((), torch.int64),
        }
        offsets, self.row_nbytes = {}, 0
        for name in FIELDS:
            shape, dtype = shapes[name]
            offsets[name] = self.row_nbytes
            self.row_nbytes += _aligned(math.prod(shape) * dtype.itemsize)
        self.storage = torch.zeros(num_rows, self.row_nbytes, dtype=torch.uint8, device=device)

        def field(name: str) -> torch.Tensor:
            shape, dtype = shapes[name]
            start = offsets[name]
            size = math.prod(shape) * dtype.itemsize
            return self.storage[:, start : start + size].view(dtype).view(num_rows, *shape)

        self.output_ids = field("output_ids")
        self.output_logprob = field("output_logprob")
        self.topk_index = field("topk_index")
        self.topk_p = field("topk_p")
        self.hidden_states = field("hidden_states")
        self.boundary_hidden = field("boundary_hidden")
        self.cached_tokens = field("cached_tokens")
        self.room = field("room")
        # Popping from the end hands out row 0 first, which keeps tests readable.
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._used_rows: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise MemoryError(f"all {self.num_rows} metadata rows are in use")
        row = self._free_rows.pop()
        self._used_rows.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used_rows:
            raise ValueError(f"metadata row {row} freed but not allocated")
        self.room[row] = 0
        self._used_rows.remove(row)
        self._free_rows.append(row)

    def write_row(
        self,
        row: int,
        *,
        room: int,
        output_id: int,
        output_logprob: float,
        hidden_state: torch.Tensor,
        topk_index: torch.Tensor | None = None,
        topk_p: torch.Tensor | None = None,
        boundary_hidden: torch.Tensor | None = None,
        cached_tokens: int = 0,
    ) -> None:
        self._check_row(row)
        if room == 0:
            raise ValueError("room 0 marks a free row; rooms start at 1")
        if hidden_state.shape[-1] != self.spec_hidden_size:
            raise ValueError(
                f"hidden state width {hidden_state.shape[-1]} != spec_hidden_size "
                f"{self.spec_hidden_size} (the draft's input is spec_hidden_size wide, "
                "not hidden_size)"
            )
        self.output_ids[row] = output_id
        self.output_logprob[row] = output_logprob
        # copy_ converts dtype and device: the caller's tensors may live elsewhere.
        self.hidden_states[row].copy_(hidden_state.reshape(self.spec_hidden_size))
        width = self.topk_index.shape[1]
        for name, value in (("topk_index", topk_index), ("topk_p", topk_p)):
            if value is None:
                getattr(self, name)[row].zero_()
                continue
            if value.numel() != width:
                raise ValueError(
                    f"{name} has {value.numel()} values, expected num_draft_steps * topk = {width}"
                )
            getattr(self, name)[row].copy_(value.reshape(width))
        if boundary_hidden is None:
            self.boundary_hidden[row].zero_()
        else:
            if boundary_hidden.shape != self.boundary_hidden.shape[1:]:
                raise ValueError(
                    f"boundary_hidden has shape {tuple(boundary_hidden.shape)}, expected "
                    f"{tuple(self.boundary_hidden.shape[1:])}"
                )
            self.boundary_hidden[row].copy_(boundary_hidden)
        self.cached_tokens[row] = cached_tokens
        self.room[row] = room

    def void(self, row: int) -> None:
        """Zero the row's room tag: sent as it is, the row lands as no room's (rooms are never
        0), so the KV sent with it is never taken for a request's."""
        self._check_row(row)
        self.room[row] = 0

    def row_landed(self, row: int, room: int) -> bool:
        self._check_row(row)
        return int(self.room[row]) == room

    def row_tensors(self, row: int) -> list[torch.Tensor]:
        """Contiguous views of one row's fields in FIELDS order (room last); 1-D each."""
        self._check_row(row)
        return [getattr(self, name)[row : row + 1].reshape(-1) for name in FIELDS]

    def row_bytes(self, row: int) -> torch.Tensor:
        """The whole row as one contiguous byte view (`row_nbytes` long), room last: what a
        transfer sends, and where a received row lands with one copy."""
        self._check_row(row)
        return self.storage[row]

    def empty_row_tensors(self) -> list[torch.Tensor]:
        """Fresh tensors shaped like `row_tensors`, for staging a row before it is copied in."""
        return [torch.empty_like(t) for t in self.row_tensors(0)]

    def copy_row_from(self, row: int, tensors: list[torch.Tensor]) -> None:
        """Copy a staged row in, room last, so `row_landed` never sees a half-written row."""
        for dst, src in zip(self.row_tensors(row), tensors, strict=True):
            dst.copy_(src)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"metadata row {row} out of range [0, {self.num_rows})")
