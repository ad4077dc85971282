"""What the draft-training tests read of a run's folder: its log and its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spec.train.trainer import CHECKPOINT_FILE, LOG_FILE


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]


def checkpoint(out: Path) -> dict:
    return torch.load(out / CHECKPOINT_FILE, weights_only=False)
