"""MetadataBuffers: the per-request state that crosses from prefill to decode besides the KV.

One preallocated tensor per field, one row per in-flight request, allocated on both sides (the
prefill node writes its row and sends it; the decode node receives into its own row).

Invariants (tested in tests/test_metadata_buffers.py):
- `room[row]` is written last by `write_row` (and by the receiver), so a row whose room tag equals
  the expected room has every other field in place: `row_landed(row, room)`;
- a free row has room tag 0 (`free` zeroes it) and rooms are never 0, so a stale row never
  passes for a landed one;
- `hidden_states` is `spec_hidden_size` wide, never `hidden_size`: a model that widens its
  residual stream (hc_mult > 1) or concatenates auxiliary hidden states hands the draft more
  than `hidden_size` values per token;
- `row_tensors(row)` lists the row's fields in `FIELDS` order with room last: the order in which
  they are sent and received.
"""

from __future__ import annotations

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

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.output_ids = zeros(num_rows, dtype=torch.int64)
        self.output_logprob = zeros(num_rows, dtype=torch.float32)
        self.topk_index = zeros(num_rows, width, dtype=torch.int64)
        self.topk_p = zeros(num_rows, width, dtype=torch.float32)
        self.hidden_states = zeros(num_rows, spec_hidden_size, dtype=hidden_dtype)
        depths_with_boundary = max(num_draft_steps - 1, 0)
        self.boundary_hidden = zeros(
            num_rows, depths_with_boundary, boundary_width, dtype=hidden_dtype
        )
        self.cached_tokens = zeros(num_rows, dtype=torch.int64)
        self.room = zeros(num_rows, dtype=torch.int64)
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

    def row_landed(self, row: int, room: int) -> bool:
        self._check_row(row)
        return int(self.room[row]) == room

    def row_tensors(self, row: int) -> list[torch.Tensor]:
        """Contiguous views of one row's fields in FIELDS order (room last); 1-D each."""
        self._check_row(row)
        return [getattr(self, name)[row : row + 1].reshape(-1) for name in FIELDS]

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
