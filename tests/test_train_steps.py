"""Every draft step trained (spec/train/steps.py, `--train-steps M`): the steps past the K
depths run the last depth again, as the engine does; each step's loss is weighted as stated;
training lowers every step's loss, the reused one's included; the saved draft runs M steps by
default and stays lossless; the replay's chains are M steps long and equal the engine's count."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tiny_drafts import target_config
from tiny_models import make_tiny_llama

from cluster.commands.cli import main
from engine import LLM, ModelLoadError, SamplingParams
from engine.executor.model_runner import build_model
from engine.loading.loader import EngineArgs, resolve
from engine.loading.weights import iter_safetensors
from engine.models.rope import RotaryEmbedding
from spec import load_draft, save_draft
from spec.config import DraftConfig
from spec.draft_model import MultiLayerEagleDraft
from spec.train.batches import make_block
from spec.train.data import Sequences
from spec.train.steps import check_train_steps, step_weights, stored_state, with_train_steps
from spec.train.trainer import distillation_step

# One CPU thread, and the predictable target: conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


def test_step_weights_follow_the_stated_rules() -> None:
    agreement = torch.tensor([0.5, 0.8, 0.25, 0.9])
    assert step_weights(agreement, "uniform").tolist() == [1.0, 1.0, 1.0, 1.0]
    assert step_weights(agreement, "uniform", 0.5).tolist() == [1.0, 0.5, 0.25, 0.125]
    # The share of rounds that reach step j: the product of the earlier steps' agreement.
    reach = [1.0, 0.5, 0.5 * 0.8, 0.5 * 0.8 * 0.25]
    assert step_weights(agreement, "accepted").tolist() == pytest.approx(reach)
    decayed = [w * 0.5**j for j, w in enumerate(reach)]
    assert step_weights(agreement, "accepted", 0.5).tolist() == pytest.approx(decayed)
    with pytest.raises(ValueError, match="supported: uniform, accepted"):
        step_weights(agreement, "equal")


def test_train_steps_are_checked() -> None:
    check_train_steps(5, 3, reusable=True)
    with pytest.raises(ValueError, match="between the draft's 3 depths and 16"):
        check_train_steps(2, 3, reusable=True)
    with pytest.raises(ValueError, match="between"):
        check_train_steps(17, 3, reusable=True)
    check_train_steps(1, 1, reusable=False)
    with pytest.raises(ValueError, match="cannot read its own output"):
        check_train_steps(2, 1, reusable=False)


@pytest.fixture(scope="module")
def target(predictable_path: Path):
    spec = resolve(EngineArgs(model=str(predictable_path), device="cpu"))
    engine_config = dataclasses.replace(spec.engine_config, cpu_packed_linear=False)
    model = build_model(spec.model_config, engine_config, iter_safetensors(spec.path))
    rotary = RotaryEmbedding(spec.model_config.rope, spec.model_config.head_dim, 1024, "cpu")
    return spec.model_config, model.requires_grad_(False), rotary


def test_training_lowers_every_steps_loss_including_a_reused_depths(
    target, predictable_path: Path, tmp_path: Path
) -> None:
    config, model, rotary = target
    torch.manual_seed(0)
    draft = with_train_steps(MultiLayerEagleDraft(config, 2), 3)
    assert draft.num_draft_steps == 3 and draft.num_stored_depths == 2
    assert draft.depths[2] is draft.depths[1]
    generator = torch.Generator().manual_seed(1)
    rows = [
        torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in (24, 20)
    ]
    block = make_block(Sequences(rows, [4, 4], {}), [0, 1], 1024, torch.device("cpu"))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    with torch.no_grad():
        before = distillation_step(draft, model, rotary, block, step_weighting="accepted")
    assert len(before.depth_loss) == 3 and all(n > 0 for n in before.num_positions)
    for _ in range(30):
        result = distillation_step(draft, model, rotary, block, step_weighting="accepted")
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = distillation_step(draft, model, rotary, block, step_weighting="accepted")
    for step, (old, new) in enumerate(zip(before.depth_loss, after.depth_loss)):
        assert new < 0.8 * old, (step, old, new)

    # Saved as the pipeline saves it: the two depths once, three steps by default.
    saved = MultiLayerEagleDraft(config, 2)
    saved.load_state_dict(stored_state(draft))
    save_draft(tmp_path / "draft", saved, "predictable", default_draft_steps=3)
    folder = DraftConfig.load(tmp_path / "draft")
    assert (folder.num_draft_steps, folder.default_draft_steps) == (2, 3)
    loaded = load_draft(tmp_path / "draft", config, None, "cpu", torch.float32)
    assert loaded.num_draft_steps == 3 and loaded.depths[2] is loaded.depths[1]
    for name, tensor in stored_state(draft).items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert load_draft(tmp_path / "draft", config, 2, "cpu", torch.float32).num_draft_steps == 2

    # The engine runs the three steps by default, and greedy output stays the plain output.
    prompts = [[5, 9, 14, 3], [7, 7, 2, 30, 31, 8], [40, 41, 42]]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(str(predictable_path), device="cpu").generate(prompts, greedy)
    llm = LLM(
        str(predictable_path),
        device="cpu",
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(tmp_path / "draft"),
    )
    assert llm.engine.speculator.num_draft_steps == 3
    spec_out = llm.generate(prompts, greedy)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain]
    assert len(spec_out[0].usage.spec_accepted_per_position) == 3


def test_a_folder_whose_default_is_fewer_steps_than_its_depths_is_refused(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "target", seed=0)
    draft = MultiLayerEagleDraft(target_config(tmp_path / "target"), 2)
    save_draft(tmp_path / "draft", draft, default_draft_steps=2)
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert "default_draft_steps" not in raw  # the same as its depths: not written
    raw["default_draft_steps"] = 1
    (tmp_path / "draft" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="default_draft_steps \\(1\\) is fewer"):
        DraftConfig.load(tmp_path / "draft")


def cli_args(out: Path, model: Path, *extra: str) -> list[str]:
    return [
        "train-draft",
        "--out", str(out),
        "--model", str(model),
        "--device", "cpu",
        "--num-prompts", "24",
        "--self-prompts", "0",
        "--num-heldout", "3",
        "--max-tokens", "12",
        "--epochs", "2",
        "--tokens-per-batch", "512",
        "--save-dtype", "float32",
        "--draft-vocab-size", "200",
        "--no-progress",
        *extra,
    ]  # fmt: skip


def test_a_run_trains_and_replays_every_step(
    predictable_path: Path, tmp_path: Path, capsys
) -> None:
    """K = 2 depths, M = 4 steps: the replay's chains are four steps long, as the engine runs
    the saved folder by default, and its count equals the engine's."""
    args = cli_args(tmp_path, predictable_path, "--num-draft-steps", "2", "--train-steps", "4")
    assert main([*args, "--step-weights", "accepted"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["schedule"]["step_weighting"] == "accepted"
    assert len(summary["final_train"]["loss"]) == 4
    assert all(len(v["acceptance"]) == 4 for v in summary["validations"])
    replay, engine = summary["draft_vocab"]["replay"], summary["engine_heldout"]
    assert len(engine["acceptance"]) == 4
    assert engine["verify_steps"] == replay["verify_steps"] > 0
    assert engine["accept_length"] == pytest.approx(replay["accept_length"], abs=1e-9)
    assert engine["acceptance"] == pytest.approx(replay["acceptance"], abs=1e-9)
    folder = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert (folder["num_draft_steps"], folder["default_draft_steps"]) == (2, 4)
    # Run again, it resumes from its checkpoint, which holds the reused depth's steps too.
    assert main([*args, "--step-weights", "accepted", "--no-evaluate"]) == 0
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["resumed"] and again["steps"] == summary["steps"]
    assert again["validations"] == summary["validations"]
    capsys.readouterr()
    # The checkpoint belongs to a four-step run; fewer steps than depths are refused.
    assert main(cli_args(tmp_path, predictable_path, "--num-draft-steps", "2")) == 2
    assert "(train_steps)" in capsys.readouterr().err
    assert main([*args[:-2], "--train-steps", "1", "--no-progress"]) == 2
    assert "train_steps (1) must be at least num_draft_steps (2)" in capsys.readouterr().err
