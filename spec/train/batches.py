"""The trainer's batches: sequences grouped by length within a token budget, padded into a
block on the training device, and the positions each depth is trained on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec.train.data import Sequences


def make_batches(
    lengths: list[int], tokens_per_batch: int, seed: int, epoch: int
) -> list[list[int]]:
    """Sequences grouped by length so that padding stays small, each group at most
    `tokens_per_batch` padded tokens (a longer sequence goes alone), in an order drawn from
    (seed, epoch): the same on a resumed run."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return [batches[j] for j in torch.randperm(len(batches), generator=generator).tolist()]


@dataclass
class Block:
    """A padded batch: tokens [B, T] on the training device, each row's real length and prompt
    length on the host (what decides the trained positions, known before any kernel runs)."""

    tokens: torch.Tensor
    lens: torch.Tensor
    prompt_lens: torch.Tensor


def make_block(data: Sequences, indices: list[int], max_len: int, device: torch.device) -> Block:
    rows = [data.tokens[i][:max_len] for i in indices]
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
    lens = torch.tensor([len(r) for r in rows])
    prompt_lens = torch.tensor([min(data.prompt_lens[i], max_len) for i in indices])
    return Block(to_device(tokens, device), lens, prompt_lens)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, copied from pinned memory without waiting for the device's queue
    (a step's inputs go over while the previous step still runs)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def drafted_positions(block: Block, depth: int) -> torch.Tensor:
    """[B, T] bool, on the host: where depth `depth` predicts an answer token that exists. At
    position i it predicts x[i+depth+2], from the target's distribution at i+depth+1."""
    t = block.tokens.shape[1]
    label = torch.arange(t, device=block.lens.device)[None, :] + depth + 1
    return (label >= block.prompt_lens[:, None] - 1) & (label <= block.lens[:, None] - 2)


def training_autocast(device: torch.device, enabled: bool):
    # bf16 matmuls on GPU with float32 master weights; CPU runs float32 throughout.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)
