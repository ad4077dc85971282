"""`pdcluster train-draft` resumes a run from its checkpoint to the weights of the run straight
through (with hidden-state noise too), and refuses a checkpoint of other settings or batches
unless told to restart."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from train_helpers import checkpoint, read_log

from engine.executor.model_runner import build_model
from engine.loading.loader import EngineArgs, resolve
from engine.loading.weights import iter_safetensors
from engine.models.rope import RotaryEmbedding
from spec.draft_model import MultiLayerEagleDraft
from spec.train.data import Sequences
from spec.train.pipeline import TrainDraftConfig, train_draft
from spec.train.trainer import DraftTrainer, Schedule

NUM_DRAFT_STEPS = 3
# One CPU thread, and the predictable target: conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


def small_config(
    out: Path, model: Path, hidden_noise: float = 0.0, **overrides
) -> TrainDraftConfig:
    schedule = Schedule(
        epochs=2,
        tokens_per_batch=512,
        warmup_steps=2,
        log_every=1,
        checkpoint_every=3,
        hidden_noise=hidden_noise,
    )
    settings = dict(
        out_dir=out,
        model=str(model),
        device="cpu",
        num_prompts=24,
        num_heldout=2,
        max_tokens=12,
        generate_batch=32,
        schedule=schedule,
        progress=False,
        save_dtype="float32",
        evaluate=False,
    )
    return TrainDraftConfig(**{**settings, **overrides})


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module", params=[0.0, 0.2], ids=["plain", "hidden-noise"])
def resume_runs(request, predictable_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """The same run twice: straight through, and killed right after a checkpoint in the middle
    of epoch 1 (of 0, 1), then started again on the same folder. With hidden-state noise too,
    whose draws must not depend on where the run was resumed."""
    noise = request.param
    fresh = tmp_path_factory.mktemp("fresh")
    whole = train_draft(small_config(fresh, predictable_path, noise))
    per_epoch = whole["steps"] // 2
    assert per_epoch >= 4, "too few steps per epoch to interrupt one in its middle"

    interrupted = tmp_path_factory.mktemp("interrupted")
    for name in ("answers.pt", "heldout.pt"):  # the same answers, not generated again
        shutil.copy(fresh / name, interrupted / name)
    save = DraftTrainer.save_checkpoint
    stopped_at = []

    def save_then_stop(self: DraftTrainer) -> None:
        save(self)
        if self.progress.step > per_epoch and not stopped_at:
            stopped_at.append(self.progress.step)
            raise Interrupted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DraftTrainer, "save_checkpoint", save_then_stop)
        with pytest.raises(Interrupted):
            train_draft(small_config(interrupted, predictable_path, noise))
    assert per_epoch < stopped_at[0] < 2 * per_epoch
    assert checkpoint(interrupted)["progress"]["step"] == stopped_at[0]
    resumed = train_draft(small_config(interrupted, predictable_path, noise))
    return SimpleNamespace(
        fresh=fresh, whole=whole, interrupted=interrupted, resumed=resumed, stopped_at=stopped_at
    )


def test_resumed_run_ends_with_the_uninterrupted_weights(resume_runs) -> None:
    runs = resume_runs
    assert not runs.whole["resumed"] and runs.resumed["resumed"]
    assert runs.resumed["steps"] == runs.whole["steps"]
    whole, resumed = checkpoint(runs.fresh), checkpoint(runs.interrupted)
    assert resumed["progress"]["step"] == whole["progress"]["step"] == runs.whole["steps"]
    for name, tensor in whole["draft"].items():
        assert torch.equal(resumed["draft"][name], tensor), name
    assert runs.resumed["validations"] == runs.whole["validations"]
    # Every step was logged once: the resumed run went on from the checkpoint's step.
    steps = [record["step"] for record in read_log(runs.interrupted) if "loss" in record]
    assert steps == list(range(1, runs.whole["steps"] + 1))


def test_checkpoint_of_other_settings_is_refused_unless_restarting(
    resume_runs, predictable_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("other") / "run"
    shutil.copytree(resume_runs.fresh, out)
    with pytest.raises(ValueError, match=r"\(num_draft_steps\)"):
        train_draft(small_config(out, predictable_path, num_draft_steps=2))
    summary = train_draft(small_config(out, predictable_path, num_draft_steps=2, restart=True))
    assert not summary["resumed"]
    assert summary["steps"] == resume_runs.whole["steps"]
    assert json.loads((out / "draft" / "config.json").read_text())["num_draft_steps"] == 2


@pytest.mark.parametrize(
    "field, value", [("seed", 1), ("tokens_per_batch", 1024)], ids=["seed", "tokens_per_batch"]
)
def test_trainer_refuses_a_checkpoint_whose_batches_differ(
    resume_runs, predictable_path: Path, field: str, value: int
) -> None:
    saved = checkpoint(resume_runs.fresh)
    schedule_keys = Schedule().resume_key().keys()
    run_key = {k: v for k, v in saved["run_key"].items() if k not in schedule_keys}
    spec = resolve(EngineArgs(model=str(predictable_path), device="cpu"))
    target = build_model(spec.model_config, spec.engine_config, iter_safetensors(spec.path))
    rotary = RotaryEmbedding(spec.model_config.rope, spec.model_config.head_dim, 1024, "cpu")
    data = Sequences.load(resume_runs.fresh / "answers.pt")
    base = small_config(resume_runs.fresh, predictable_path).schedule

    def trainer(schedule: Schedule) -> DraftTrainer:
        draft = MultiLayerEagleDraft(spec.model_config, NUM_DRAFT_STEPS)
        return DraftTrainer(
            draft, target, rotary, data, None, schedule, resume_runs.fresh, run_key, False
        )

    same = trainer(base)
    assert same.resume() and same.progress.step == resume_runs.whole["steps"]
    other = dataclasses.replace(base, **{field: value})
    with pytest.raises(ValueError, match=rf"\({field}\)"):
        trainer(other).resume()
