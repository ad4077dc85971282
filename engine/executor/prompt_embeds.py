"""Inputs given as embeddings: a request may give a vector for some prompt positions instead of
a token's embedding (prompt embeddings, multimodal placeholders). The token id at such a position
stays in the prompt as a placeholder; the target reads the given vector there, and so does the
draft's prefill when that position is the token a depth reads."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.errors import RequestRejectedError

Vector = Sequence[float] | torch.Tensor


@dataclass(frozen=True)
class PromptEmbeds:
    """The given vectors of one request: `values[j]` replaces the embedding of the prompt token
    at `positions[j]` (sorted, distinct)."""

    positions: tuple[int, ...]
    values: torch.Tensor  # [len(positions), width] float32 on the CPU

    @classmethod
    def of(cls, given: Mapping[int, Vector] | Iterable[tuple[int, Vector]]) -> PromptEmbeds:
        """From {position: vector} or (position, vector) pairs; raises RequestRejectedError
        for a position given twice, a vector that is not numbers, or vectors of unequal width."""
        pairs = list(given.items() if isinstance(given, Mapping) else given)
        if not pairs:
            raise RequestRejectedError("prompt_embeds is empty: give at least one position")
        vectors: dict[int, torch.Tensor] = {}
        for position, vector in pairs:
            if isinstance(position, bool) or not isinstance(position, int):
                raise RequestRejectedError(f"prompt_embeds position {position!r} is not an integer")
            if position in vectors:
                raise RequestRejectedError(f"prompt_embeds gives position {position} twice")
            vectors[position] = _as_vector(position, vector)
        positions = tuple(sorted(vectors))
        width = vectors[positions[0]].shape[0]
        for position in positions:
            if vectors[position].shape[0] != width:
                raise RequestRejectedError(
                    f"prompt_embeds at position {position} has {vectors[position].shape[0]} "
                    f"values, at position {positions[0]} {width}"
                )
        return cls(positions, torch.stack([vectors[p] for p in positions]))

    def to_bytes(self) -> bytes:
        """The values as float32, row after row (for a control-plane message)."""
        return self.values.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()

    @classmethod
    def from_bytes(cls, positions: Sequence[int], width: int, data: bytes) -> PromptEmbeds:
        values = torch.frombuffer(bytearray(data), dtype=torch.float32)
        if values.numel() != len(positions) * width:
            raise RequestRejectedError(
                f"prompt_embeds carries {values.numel()} values for {len(positions)} positions "
                f"of width {width}"
            )
        return cls(tuple(positions), values.view(len(positions), width))

    @property
    def width(self) -> int:
        return int(self.values.shape[1])

    def check(self, num_prompt_tokens: int, hidden_size: int) -> None:
        """Raise RequestRejectedError unless every vector fits the model and the prompt."""
        if self.width != hidden_size:
            raise RequestRejectedError(
                f"prompt_embeds vectors have {self.width} values, but the model's hidden size "
                f"is {hidden_size}"
            )
        outside = [p for p in self.positions if not 0 <= p < num_prompt_tokens]
        if outside:
            raise RequestRejectedError(
                f"prompt_embeds position {outside[0]} is outside the prompt of "
                f"{num_prompt_tokens} tokens (positions 0 to {num_prompt_tokens - 1})"
            )
        bad = ~torch.isfinite(self.values).all(dim=1)
        if bad.any():
            position = self.positions[int(bad.nonzero()[0])]
            raise RequestRejectedError(f"prompt_embeds at position {position} is not finite")

    def rows(self, start: int, end: int) -> InputEmbeds | None:
        """The rows of positions [start, end), None when none of them was given."""
        inside = [j for j, p in enumerate(self.positions) if start <= p < end]
        if not inside:
            return None
        values = torch.zeros(end - start, self.width, dtype=self.values.dtype)
        mask = torch.zeros(end - start, dtype=torch.bool)
        offsets = torch.tensor([self.positions[j] - start for j in inside])
        values[offsets] = self.values[inside]
        mask[offsets] = True
        return InputEmbeds(values, mask)


@dataclass(frozen=True)
class InputEmbeds:
    """Per-token embedding overrides of a run of consecutive tokens: where `mask` is True,
    `values` replaces the token's embedding (ForwardBatch.input_embeds, one request's part)."""

    values: torch.Tensor  # [n, width]
    mask: torch.Tensor  # [n] bool

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    def split(self, lengths: list[int]) -> list[InputEmbeds]:
        return [
            InputEmbeds(v, m) for v, m in zip(self.values.split(lengths), self.mask.split(lengths))
        ]

    def window(self, start: int, end: int) -> InputEmbeds | None:
        """Rows [start, end); rows past the end of these overrides are not overridden."""
        assert 0 <= start <= end
        stop = min(end, len(self))
        if start >= stop:
            return None
        values, mask = self.values[start:stop], self.mask[start:stop]
        missing = end - stop
        if missing:
            values = torch.cat([values, values.new_zeros(missing, values.shape[1])])
            mask = torch.cat([mask, mask.new_zeros(missing)])
        return InputEmbeds(values, mask)


def concat_input_embeds(
    pieces: list[InputEmbeds | None],
    lengths: list[int],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """ForwardBatch.input_embeds [T, width] and input_embeds_mask [T] for a batch whose request
    i brings `lengths[i]` tokens and overrides `pieces[i]`; (None, None) when none has any."""
    given = [piece for piece in pieces if piece is not None]
    if not given:
        return None, None
    width = given[0].values.shape[1]
    dtype = dtype or given[0].values.dtype
    values, masks = [], []
    for piece, length in zip(pieces, lengths):
        if piece is None:
            values.append(torch.zeros(length, width, dtype=dtype, device=device))
            masks.append(torch.zeros(length, dtype=torch.bool, device=device))
        else:
            assert len(piece) == length, "one override row per token"
            values.append(piece.values.to(device=device, dtype=dtype))
            masks.append(piece.mask.to(device))
    return torch.cat(values), torch.cat(masks)


def _as_vector(position: int, vector: Vector) -> torch.Tensor:
    if isinstance(vector, torch.Tensor):
        if not (vector.is_floating_point() or vector.dtype in (torch.int32, torch.int64)):
            raise RequestRejectedError(f"prompt_embeds at position {position} is not numbers")
        values = vector.detach().to("cpu", torch.float32)
    else:
        if isinstance(vector, str | bytes) or any(
            isinstance(x, bool) or not isinstance(x, int | float) for x in vector
        ):
            raise RequestRejectedError(
                f"prompt_embeds at position {position} must be a list of numbers"
            )
        values = torch.tensor([_to_float(x) for x in vector], dtype=torch.float32)
    if values.dim() != 1 or values.shape[0] == 0:
        raise RequestRejectedError(
            f"prompt_embeds at position {position} must be one non-empty vector, "
            f"got shape {tuple(values.shape)}"
        )
    return values


def _to_float(x: float) -> float:
    try:
        return float(x)
    except OverflowError:  # an integer beyond float range: `check` refuses it as not finite
        return math.inf


EmbedsArg = PromptEmbeds | Mapping[int, Vector]


def per_prompt(
    prompt_embeds: EmbedsArg | Sequence[EmbedsArg | None] | None, num_prompts: int
) -> list[PromptEmbeds | None]:
    """One PromptEmbeds (or None) per prompt from what LLM.generate was given: nothing, one
    {position: vector} mapping (or PromptEmbeds) for a single prompt, or one per prompt."""
    if prompt_embeds is None:
        return [None] * num_prompts
    if isinstance(prompt_embeds, PromptEmbeds | Mapping):
        prompt_embeds = [prompt_embeds]
    given = list(prompt_embeds)
    if len(given) != num_prompts:
        raise ValueError(f"{len(given)} prompt_embeds for {num_prompts} prompts")
    return [
        None if item is None else item if isinstance(item, PromptEmbeds) else PromptEmbeds.of(item)
        for item in given
    ]
