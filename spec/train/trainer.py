"""Training K draft depths by self-distillation from the target.

Every step runs the target over a batch of its own answers (spec.train.data), then every depth
teacher-forced over the same positions (spec.train.dense): depth 0 on the target's hidden
states, depth d on depth d-1's outputs. Depth d at position i learns the target's next-token
distribution at position i+d+1, i.e. to predict x[i+d+2], which is what it proposes at decode
time. Only positions whose prediction falls in the answer count: prompt tokens are the user's,
not the target's, and are never drafted.

A run is deterministic for a seed and resumes from its last checkpoint."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.llama import LlamaForCausalLM
from engine.models.rope import RotaryEmbedding
from spec.draft_model import MultiLayerEagleDraft
from spec.train.batches import (
    Block,
    drafted_positions,
    make_batches,
    make_block,
    to_device,
    training_autocast,
)
from spec.train.data import Sequences, progress_interval
from spec.train.dense import draft_forward, target_forward
from spec.train.replay import Validation, validate
from spec.train.steps import StepWeighting, step_weights

CHECKPOINT_FILE = "checkpoint.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class Schedule:
    """Optimisation settings. `resume_key` lists the ones a checkpoint must agree with (they
    decide the batches); the rest may change between a run and its resumption."""

    epochs: int = 3
    tokens_per_batch: int = 8192
    lr: float = 5e-4
    min_lr_ratio: float = 0.1  # cosine decay down to lr * this
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    log_every: int = 10
    max_seq_len: int = 1024  # longer sequences are cut (their answers' tails unused)
    detach_between_depths: bool = False
    # Gaussian noise added to the target hidden states depth 0 reads, relative to each state's
    # RMS: the draft must not lean on details of states it has seen (EAGLE trains with noise).
    hidden_noise: float = 0.0
    # Depth d's loss counts decay**d in the step's total (1: all alike). EAGLE-3's training
    # weights its steps so, with 0.8: the first depths, accepted most often, matter most.
    depth_loss_decay: float = 1.0
    # How each draft step's loss counts (spec.train.steps.step_weights): "uniform", or
    # "accepted", by the share of verify rounds that reach the step.
    step_weighting: StepWeighting = "uniform"

    def resume_key(self) -> dict:
        return {
            "tokens_per_batch": self.tokens_per_batch,
            "seed": self.seed,
            "max_seq_len": self.max_seq_len,
        }


@dataclass
class StepResult:
    loss: torch.Tensor  # the weighted sum over draft steps, with its graph
    # [2, K], detached, on the step's device: each depth's loss (row 0) and top-1 agreement
    # with the target, teacher-forced (row 1). Read on the host only when logged: reading
    # them every step would make the host wait for the device every step.
    stats: torch.Tensor
    num_positions: list[int]

    @property
    def depth_loss(self) -> list[float]:
        return self.stats[0].tolist()

    @property
    def depth_accuracy(self) -> list[float]:
        return self.stats[1].tolist()


def distillation_step(
    draft: MultiLayerEagleDraft,
    target: LlamaForCausalLM,
    rotary: RotaryEmbedding,
    block: Block,
    detach_between_depths: bool = False,
    hidden_noise: float = 0.0,
    noise_seed: int = 0,
    depth_loss_decay: float = 1.0,
    step_weighting: StepWeighting = "uniform",
) -> StepResult:
    """Cross-entropy of each draft step against the target's own distribution (soft labels),
    summed with the weights of spec.train.steps.step_weights (`step_weighting`, with step d's
    also scaled by depth_loss_decay**d). The steps are the draft's `depths`: its stored depths,
    then its last depth again where the draft reuses it. `noise_seed` seeds the hidden-state
    noise: one seed per step keeps a resumed run exact."""
    target_hidden, last = target_forward(target, rotary, block.tokens)
    if hidden_noise > 0:
        rms = target_hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
        generator = torch.Generator(target_hidden.device).manual_seed(noise_seed)
        noise = torch.randn(target_hidden.shape, generator=generator, device=target_hidden.device)
        noise = noise * rms * hidden_noise
        target_hidden = (target_hidden.float() + noise).to(target_hidden.dtype)
    with torch.no_grad():
        target_logits = target.lm_head_logits(last)
    outputs = draft_forward(
        draft, target, rotary, block.tokens, target_hidden, detach_between_depths
    )
    device = block.tokens.device
    stats = torch.zeros(2, len(outputs), device=device)
    losses, counts = [], []
    for d, out in enumerate(outputs):
        # Chosen on the host: no kernel waits for a count of positions.
        rows = to_device(drafted_positions(block, d).reshape(-1).nonzero().squeeze(1), device)
        counts.append(rows.numel())
        if rows.numel() == 0:
            losses.append(torch.zeros((), device=device))
            continue
        labels = target_logits[rows + d + 1]
        logits = target.lm_head_logits(out[rows])
        loss = -(F.softmax(labels, dim=-1) * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        losses.append(loss)
        stats[0, d] = loss.detach()
        stats[1, d] = (logits.detach().argmax(-1) == labels.argmax(-1)).float().mean()
    weights = step_weights(stats[1], step_weighting, depth_loss_decay)
    total = (weights * torch.stack(losses)).sum()
    return StepResult(total, stats, counts)


def learning_rate(schedule: Schedule, step: int, total_steps: int) -> float:
    if step < schedule.warmup_steps:
        return schedule.lr * (step + 1) / schedule.warmup_steps
    progress = (step - schedule.warmup_steps) / max(1, total_steps - schedule.warmup_steps)
    floor = schedule.min_lr_ratio
    return schedule.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Progress:
    """Where a run stands: saved with every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of `epoch` already done
    elapsed_s: float = 0.0
    validations: list[dict] = field(default_factory=list)


class DraftTrainer:
    def __init__(
        self,
        draft: MultiLayerEagleDraft,
        target: LlamaForCausalLM,
        rotary: RotaryEmbedding,
        train: Sequences,
        heldout: Sequences | None,
        schedule: Schedule,
        out_dir: Path,
        run_key: dict,
        progress_bar: bool = True,
    ) -> None:
        self.draft = draft
        self.target = target.requires_grad_(False)
        self.rotary = rotary
        self.train_data = train
        self.heldout = heldout
        self.schedule = schedule
        self.out_dir = Path(out_dir)
        self.device = next(draft.parameters()).device
        self.autocast = self.device.type == "cuda"
        self.run_key = {**run_key, **schedule.resume_key()}
        self.progress_bar = progress_bar
        # One kernel for the update on a GPU, in place of a few per parameter group.
        self.optimizer = torch.optim.AdamW(
            draft.parameters(),
            lr=schedule.lr,
            weight_decay=schedule.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.progress = Progress()
        self.lengths = [min(len(t), schedule.max_seq_len) for t in train.tokens]

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT_FILE

    def batches_per_epoch(self) -> int:
        return len(make_batches(self.lengths, self.schedule.tokens_per_batch, 0, 0))

    def resume(self) -> bool:
        """Continue from the checkpoint in out_dir, if any; refuse one of another run."""
        if not self.checkpoint_path.exists():
            return False
        saved = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        if saved["run_key"] != self.run_key:
            keys = self.run_key.keys() | saved["run_key"].keys()
            differ = sorted(k for k in keys if saved["run_key"].get(k) != self.run_key.get(k))
            raise ValueError(
                f"{self.checkpoint_path} belongs to a run with other settings "
                f"({', '.join(differ)}); use another --out folder or --restart"
            )
        self.draft.load_state_dict(saved["draft"])
        state = saved["optimizer"]
        # A checkpoint's groups replace this optimizer's settings: one saved by an unfused AdamW
        # would turn the fused one off, whose update then reads each step count from the GPU
        # every step. Told fused, the loader also puts the counts where the fused update wants.
        for group in state["param_groups"]:
            group["fused"] = self.optimizer.defaults["fused"]
        self.optimizer.load_state_dict(state)
        self.progress = Progress(**saved["progress"])
        return True

    def save_checkpoint(self) -> None:
        partial = self.checkpoint_path.with_name(CHECKPOINT_FILE + ".partial")
        torch.save(
            {
                "draft": self.draft.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "progress": asdict(self.progress),
                "run_key": self.run_key,
            },
            partial,
        )
        os.replace(partial, self.checkpoint_path)

    def log(self, record: dict) -> None:
        with open(self.out_dir / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def validate(self) -> Validation | None:
        if self.heldout is None or not len(self.heldout):
            return None
        self.draft.eval()
        try:
            return validate(
                self.draft,
                self.target,
                self.rotary,
                self.heldout,
                self.schedule.tokens_per_batch,
                self.schedule.max_seq_len,
                self.device,
                self.autocast,
            )
        finally:
            self.draft.train()

    def _epoch_batches(self, epoch: int) -> Iterator[tuple[int, list[int]]]:
        batches = make_batches(
            self.lengths, self.schedule.tokens_per_batch, self.schedule.seed, epoch
        )
        start = self.progress.batch if epoch == self.progress.epoch else 0
        for index in range(start, len(batches)):
            yield index, batches[index]

    def run(self) -> Progress:
        """Train to the end of the schedule from wherever the run stands."""
        from tqdm.auto import tqdm

        s = self.schedule
        per_epoch = self.batches_per_epoch()
        total = per_epoch * s.epochs
        self.draft.train()
        bar = tqdm(
            total=total,
            initial=self.progress.step,
            desc="draft",
            disable=not self.progress_bar,
            mininterval=progress_interval(),
        )
        window: list[StepResult] = []
        started = time.perf_counter() - self.progress.elapsed_s
        with bar:
            for epoch in range(self.progress.epoch, s.epochs):
                for index, indices in self._epoch_batches(epoch):
                    lr = learning_rate(s, self.progress.step, total)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    block = make_block(self.train_data, indices, s.max_seq_len, self.device)
                    with training_autocast(self.device, self.autocast):
                        result = distillation_step(
                            self.draft,
                            self.target,
                            self.rotary,
                            block,
                            s.detach_between_depths,
                            s.hidden_noise,
                            noise_seed=s.seed * 1_000_003 + self.progress.step,
                            depth_loss_decay=s.depth_loss_decay,
                            step_weighting=s.step_weighting,
                        )
                    self.optimizer.zero_grad(set_to_none=True)
                    result.loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.draft.parameters(), s.grad_clip)
                    self.optimizer.step()
                    self.progress.step += 1
                    self.progress.epoch, self.progress.batch = epoch, index + 1
                    self.progress.elapsed_s = time.perf_counter() - started
                    window.append(result)
                    bar.update(1)
                    if self.progress.step % s.log_every == 0 or self.progress.step == total:
                        losses, accuracies = self._log_window(window, lr, started)
                        bar.set_postfix(
                            loss=f"{sum(losses):.3f}",
                            acc="/".join(f"{a:.2f}" for a in accuracies),
                        )
                        window = []
                    if self.progress.step % s.checkpoint_every == 0:
                        self.save_checkpoint()
                self.progress.epoch, self.progress.batch = epoch + 1, 0
                validation = self.validate()
                if validation is not None:
                    record = {"epoch": epoch + 1, "step": self.progress.step, **asdict(validation)}
                    self.progress.validations.append(record)
                    self.log({"validation": record})
                    bar.write(
                        f"epoch {epoch + 1}: held-out accept length "
                        f"{validation.accept_length:.2f}, acceptance per position "
                        + ", ".join(f"{a:.2f}" for a in validation.acceptance)
                    )
                self.save_checkpoint()
        return self.progress

    def _log_window(
        self, window: list[StepResult], lr: float, started: float
    ) -> tuple[list[float], list[float]]:
        """Log the window's means, each step weighted by its positions; returns the last step's
        losses and agreements. One read of the device for the whole window."""
        stats = torch.stack([r.stats for r in window]).tolist()  # [steps][2][K]
        # The read waited for the window's steps, so the clock now counts their device time too
        # (the host runs up to a step ahead of the device between reads).
        self.progress.elapsed_s = time.perf_counter() - started
        k = len(window[0].num_positions)
        weights = [[r.num_positions[d] for r in window] for d in range(k)]

        def mean(row: int, d: int) -> float:
            total = sum(weights[d]) or 1
            return sum(step[row][d] * w for step, w in zip(stats, weights[d])) / total

        self.log(
            {
                "step": self.progress.step,
                "epoch": self.progress.epoch,
                "lr": lr,
                "loss": [round(mean(0, d), 5) for d in range(k)],
                "accuracy": [round(mean(1, d), 5) for d in range(k)],
                "positions": sum(sum(w) for w in weights),
                "elapsed_s": round(self.progress.elapsed_s, 2),
            }
        )
        return stats[-1][0], stats[-1][1]
