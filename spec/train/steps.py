"""The draft steps a run trains: its K stored depths, then (with `train_steps` > K) the last
depth again at every further step, exactly as an engine runs a draft for more steps than it has
depths (`MultiLayerEagleDraft.reuse_last_depth`): the same module, each step reading the
previous step's output. And how each step's loss counts in a training step's total."""

from __future__ import annotations

from typing import Literal

import torch

from spec.draft_model import MAX_DRAFT_STEPS, MultiLayerEagleDraft

StepWeighting = Literal["uniform", "accepted"]
STEP_WEIGHTINGS: tuple[StepWeighting, ...] = ("uniform", "accepted")


def check_train_steps(train_steps: int, num_depths: int, reusable: bool) -> None:
    """Refuse a step count an engine could not run with these depths. `reusable`: whether the
    last depth reads states as wide as it writes; a lone depth 0 that reads several target
    layers side by side (spec_hidden_size > hidden_size) cannot read its own output."""
    if not num_depths <= train_steps <= MAX_DRAFT_STEPS:
        raise ValueError(
            f"train_steps must be between the draft's {num_depths} depths and "
            f"{MAX_DRAFT_STEPS}, got {train_steps}"
        )
    if train_steps > num_depths and not reusable:
        raise ValueError(
            "train_steps beyond a single depth that reads several target layers (aux_layers): "
            "that depth cannot read its own output; train at least two depths"
        )


def with_train_steps(draft: MultiLayerEagleDraft, train_steps: int) -> MultiLayerEagleDraft:
    """`draft` running `train_steps` steps, the ones past its depths by its last depth."""
    draft.reuse_last_depth(train_steps)
    return draft


def stored_state(draft: MultiLayerEagleDraft) -> dict[str, torch.Tensor]:
    """The state dict of the depths with weights of their own: what a draft of
    `num_stored_depths` depths loads (a reused depth's names are the same tensors again)."""
    stored = draft.num_stored_depths
    return {
        name: tensor
        for name, tensor in draft.state_dict().items()
        if not name.startswith("depths.") or int(name.split(".")[1]) < stored
    }


def step_weights(
    agreement: torch.Tensor, weighting: StepWeighting, decay: float = 1.0
) -> torch.Tensor:
    """Each step's weight in a training step's total loss, [M], on `agreement`'s device.

    "uniform": w_j = decay**j (decay 1: every step alike).

    "accepted": w_j = decay**j * a_0 * a_1 * ... * a_(j-1), with a_i the top-1 agreement of
    step i with the target in this batch (teacher-forced, so step i's agreement where every step
    before it was right): the share of verify rounds that reach step j when each step is
    accepted as often as it agrees, and so the share of the accepted tokens that step j's
    proposal can add. Step 0 always counts 1. The weights are constants of the step (no
    gradient flows through them), and they follow the batch, so a later step gains weight as the
    steps before it learn.

    `agreement`: [M] per-step agreement, read without the host waiting for the device."""
    steps = agreement.shape[0]
    powers = torch.arange(steps, device=agreement.device, dtype=torch.float32)
    weights = torch.full((steps,), float(decay), device=agreement.device).pow(powers)
    if weighting == "uniform":
        return weights
    if weighting != "accepted":
        raise ValueError(
            f"unknown step weighting {weighting!r}; supported: {', '.join(STEP_WEIGHTINGS)}"
        )
    reach = torch.ones(steps, device=agreement.device)
    if steps > 1:
        reach[1:] = torch.cumprod(agreement.detach().float()[:-1], dim=0)
    return weights * reach
