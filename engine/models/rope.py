"""Rotary position embeddings with the scaling variants HF configs name (default, linear, llama3,
yarn). cos/sin are precomputed in float32 for every position and looked up per token."""

from __future__ import annotations

import math

import torch

from engine.model_config import RopeConfig


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim / 2], attention scaling applied to cos and sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_positions)
    raise ValueError(f"unknown rope type {rope.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings or 8192
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    original = rope.original_max_position_embeddings or max_positions
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


class RotaryEmbedding:
    """cos and sin tables of every position, one per rotary embedding the model has: its own,
    then its sliding-window layers' where they rotate with another (`RopeConfig.local`)."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, device: str | torch.device
    ) -> None:
        ropes = [rope] if rope.local is None else [rope, rope.local]
        positions = torch.arange(max_positions, dtype=torch.float32)
        tables = []
        for each in ropes:
            inv_freq, scaling = inverse_frequencies(each, head_dim, max_positions)
            freqs = torch.outer(positions, inv_freq)
            angles = torch.cat([freqs, freqs], dim=-1)
            tables.append(torch.stack([angles.cos() * scaling, angles.sin() * scaling], dim=1))
        # [positions, embeddings, 2 (cos, sin), D]: a forward's lookup is one gather.
        self.table = torch.stack(tables, dim=1).to(device)
        # The table in each dtype a forward asked for, converted once, not at every lookup.
        self._typed = {torch.float32: self.table}

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, E, D] for the given positions (views of one tensor), looked up once
        per forward: E = 1, or 2 where sliding-window layers rotate with an embedding of their
        own (column 1; engine.models.llama.Attention picks its layer's)."""
        table = self._typed.get(dtype)
        if table is None:
            table = self.table.to(dtype)
            # Converted inside a graph's capture, the copy would hold nothing until a replay.
            if not (table.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._typed[dtype] = table
        both = table[positions]
        return both[:, :, 0], both[:, :, 1]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] -> rotated copies."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
