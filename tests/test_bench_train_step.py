"""bench/train_step.py on the CPU with the tiny random shape: it runs the trainer's own loop
twice and reports the time a step as their difference."""

from __future__ import annotations

import re

import pytest

from bench import train_step
from spec.train.trainer import DraftTrainer


def test_the_difference_of_two_runs_is_reported_per_step(monkeypatch, capsys) -> None:
    runs = []
    run = DraftTrainer.run

    def counting(trainer):
        progress = run(trainer)
        runs.append(progress.step)
        return progress

    monkeypatch.setattr(DraftTrainer, "run", counting)
    train_step.main(["--shape", "tiny", "--num-draft-steps", "2", "--tokens-per-batch", "1024",
                     "--steps", "3"])  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(
        r"tiny, cpu, 2 depths, MLP 128, 1024 tokens a step: ([0-9.]+) ms a step "
        r"\((\d+) steps between runs of (\d+) and (\d+)\)",
        line,
    )
    assert match, line
    assert float(match[1]) > 0
    assert [int(match[3]), int(match[4])] == runs
    assert int(match[2]) == runs[1] - runs[0] >= 2


def test_refuses_no_steps() -> None:
    with pytest.raises(SystemExit):
        train_step.main(["--shape", "tiny", "--steps", "0"])
