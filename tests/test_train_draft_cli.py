"""`pdcluster train-draft`'s command line: the flags reach the run's config, bad values are
refused with a message before any work, and shards made with --generate-only are trained on
with --data-from (the run itself: test_train_draft.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import read_log

from cluster.commands.cli import main
from spec.train.pipeline import TrainDraftConfig

# One CPU thread, and the predictable target: conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


def cli_args(out: Path, model: Path, *extra: str) -> list[str]:
    return [
        "train-draft",
        "--out", str(out),
        "--model", str(model),
        "--device", "cpu",
        "--num-prompts", "16",
        "--self-prompts", "4",
        "--self-prompt-max-tokens", "12",
        "--num-heldout", "2",
        "--max-tokens", "8",
        "--epochs", "1",
        "--tokens-per-batch", "512",
        "--no-progress",
        "--no-evaluate",
        *extra,
    ]  # fmt: skip


def test_cli_trains_a_draft(predictable_path: Path, tmp_path: Path, capsys) -> None:
    assert main(cli_args(tmp_path, predictable_path)) == 0
    assert "draft written to" in capsys.readouterr().out
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["num_draft_steps"] == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["data"]["train_conversations"] == 20
    assert summary["data"]["self_written_conversations"] == 4
    assert len(json.loads((tmp_path / "self_prompts.json").read_text())["prompts"]) == 4
    assert summary["data"]["heldout_conversations"] == 2
    assert "engine_heldout" not in summary

    assert main(cli_args(tmp_path, predictable_path, "--aux-layers", "99")) == 2
    assert "aux_layers" in capsys.readouterr().err


def config_from_cli(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> TrainDraftConfig:
    """The config the CLI hands to train_draft, which is stopped there."""

    class Stop(Exception):
        pass

    seen = []

    def capture(config: TrainDraftConfig) -> dict:
        seen.append(config)
        raise Stop

    monkeypatch.setattr("spec.train.pipeline.train_draft", capture)
    with pytest.raises(Stop):
        main(argv)
    return seen[0]


@pytest.mark.parametrize(
    "flags, detach, decay",
    [([], False, 1.0), (["--detach-between-depths", "--depth-loss-decay", "0.8"], True, 0.8)],
    ids=["defaults", "given"],
)
def test_cli_passes_the_depth_settings_to_the_schedule(
    monkeypatch: pytest.MonkeyPatch, predictable_path: Path, tmp_path: Path, flags, detach, decay
) -> None:
    config = config_from_cli(monkeypatch, cli_args(tmp_path, predictable_path, *flags))
    assert config.schedule.detach_between_depths == detach
    assert config.schedule.depth_loss_decay == decay


def test_cli_compares_drafts_only_with_the_evaluation(
    monkeypatch: pytest.MonkeyPatch, predictable_path: Path, tmp_path: Path, capsys
) -> None:
    args = cli_args(tmp_path, predictable_path, "--compare-draft", "a", "--compare-draft", "b")
    assert main(args) == 2
    assert "--compare-draft) needs the held-out evaluation" in capsys.readouterr().err

    config = config_from_cli(monkeypatch, [arg for arg in args if arg != "--no-evaluate"])
    assert config.compare_drafts == (Path("a"), Path("b"))


def test_cli_refuses_zero_draft_steps(predictable_path: Path, tmp_path: Path, capsys) -> None:
    assert main(cli_args(tmp_path, predictable_path, "--num-draft-steps", "0")) == 2
    assert "num_draft_steps" in capsys.readouterr().err
    assert main(cli_args(tmp_path, predictable_path, "--draft-intermediate-size", "0")) == 2
    assert "draft_intermediate_size must be positive" in capsys.readouterr().err
    assert main(cli_args(tmp_path, predictable_path, "--depth-loss-decay", "0")) == 2
    assert "depth_loss_decay must be positive" in capsys.readouterr().err
    assert not (tmp_path / "answers.pt").exists()


def test_cli_trains_on_data_generated_by_other_runs(
    predictable_path: Path, tmp_path: Path, capsys
) -> None:
    """Shards made with --generate-only and their own seeds, trained on with --data-from."""
    shard = tmp_path / "shard"
    only = ("--num-prompts", "0", "--seed", "7", "--generate-only")
    assert main(cli_args(shard, predictable_path, *only)) == 0
    assert "4 training conversations" in capsys.readouterr().out
    assert (shard / "self_answers.pt").exists()
    assert not (shard / "checkpoint.pt").exists() and not (shard / "draft").exists()
    shard_tokens = json.loads((shard / "summary.json").read_text())["data"]["train_tokens"]

    alone = tmp_path / "alone"
    assert main(cli_args(alone, predictable_path)) == 0
    alone_tokens = json.loads((alone / "summary.json").read_text())["data"]["train_tokens"]
    out = tmp_path / "main"
    # With depths narrower than the target's MLP, which the saved draft declares.
    narrow = ("--draft-intermediate-size", "40")
    assert main(cli_args(out, predictable_path, "--data-from", str(shard), *narrow)) == 0
    assert json.loads((out / "draft" / "config.json").read_text())["intermediate_size"] == 40
    data = json.loads((out / "summary.json").read_text())["data"]
    assert data["data_from_conversations"] == 4
    assert data["train_conversations"] == 24
    assert data["train_tokens"] == alone_tokens + shard_tokens
    positions = sum(r["positions"] for r in read_log(out) if "loss" in r)
    assert positions > sum(r["positions"] for r in read_log(alone) if "loss" in r)
    capsys.readouterr()

    # The checkpoint belongs to a run with the shard's data and these depths: without either,
    # it is refused.
    assert main(cli_args(out, predictable_path, *narrow)) == 2
    assert "(data_from)" in capsys.readouterr().err
    assert main(cli_args(out, predictable_path, "--data-from", str(shard))) == 2
    assert "(intermediate_size)" in capsys.readouterr().err
    other = tmp_path / "other-cap"
    assert main(cli_args(other, predictable_path, *only, "--max-tokens", "6")) == 0
    assert main(cli_args(tmp_path / "x", predictable_path, "--data-from", str(other))) == 2
    assert "other settings than this run (max_tokens)" in capsys.readouterr().err
    assert main(cli_args(out, predictable_path, "--data-from", str(out))) == 2
    assert "data_from" in capsys.readouterr().err
