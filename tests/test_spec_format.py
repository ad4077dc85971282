"""The draft folder format (docs/draft-format.md): a round trip keeps every weight, and a draft
made for another target, or a broken folder, is refused at load with a message that says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_drafts import make_random_draft, target_config
from tiny_models import make_tiny_llama

from engine import LLM, ModelLoadError, SamplingParams
from spec import DraftMismatchError, MultiLayerEagleDraft, load_draft, save_draft
from spec.config import DRAFT_ARCHITECTURE

LAYER_NAMES = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec_format") / "target"
    make_tiny_llama(path, seed=0)
    return path


def test_round_trip_keeps_every_weight(target: Path, tmp_path: Path) -> None:
    config = target_config(target)
    torch.manual_seed(3)
    draft = MultiLayerEagleDraft(config, 3)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()  # norms too, so a swapped or dropped weight shows
    save_draft(tmp_path / "draft", draft, target_name="tiny")
    loaded = load_draft(tmp_path / "draft", config, None, "cpu", torch.float32)
    assert loaded.num_draft_steps == 3
    ours, theirs = draft.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=0, atol=0, msg=name)


def test_a_narrower_mlp_survives_the_round_trip_and_speculates(
    target: Path, tmp_path: Path
) -> None:
    """Depths with their own MLP width (`intermediate_size` in config.json) load with it, and
    speculation over them keeps the greedy output; the target's width is not written."""
    config = target_config(target)
    torch.manual_seed(5)
    draft = MultiLayerEagleDraft(config, 2, intermediate_size=48)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(std=0.1)
    save_draft(tmp_path / "narrow", draft, target_name="tiny")
    raw = json.loads((tmp_path / "narrow" / "config.json").read_text())
    assert raw["intermediate_size"] == 48
    assert raw["target"]["intermediate_size"] == 128
    tensors = load_file(str(tmp_path / "narrow" / "model.safetensors"))
    assert tensors["depths.1.layer.mlp.gate_proj.weight"].shape == (48, 64)
    assert tensors["depths.1.layer.mlp.down_proj.weight"].shape == (64, 48)
    loaded = load_draft(tmp_path / "narrow", config, None, "cpu", torch.float32)
    assert loaded.intermediate_size == 48
    for name, tensor in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    save_draft(tmp_path / "same", MultiLayerEagleDraft(config, 1, intermediate_size=128))
    assert "intermediate_size" not in json.loads((tmp_path / "same" / "config.json").read_text())

    prompts = [[5, 9, 14, 3], [7, 7, 2, 30, 31, 8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(str(target), device="cpu", dtype="float32").generate(prompts, params)
    spec = LLM(
        str(target),
        device="cpu",
        dtype="float32",
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(tmp_path / "narrow"),
    ).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.usage.spec_verify_steps for o in spec)


@pytest.mark.parametrize("value", [0, -3, 1.5, "768"])
def test_a_broken_mlp_width_is_refused(target: Path, tmp_path: Path, value) -> None:
    make_random_draft(tmp_path / "draft", target, 1)
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    (tmp_path / "draft" / "config.json").write_text(json.dumps({**raw, "intermediate_size": value}))
    with pytest.raises(ModelLoadError, match="intermediate_size must be a positive integer"):
        load_draft(tmp_path / "draft", target_config(target), None, "cpu", torch.float32)


def test_mlp_weights_of_another_width_than_declared_are_refused(
    target: Path, tmp_path: Path
) -> None:
    save_draft(tmp_path / "draft", MultiLayerEagleDraft(target_config(target), 1, None, 48))
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    del raw["intermediate_size"]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"layer\.mlp\..*has shape \(.*48.*\), expected"):
        load_draft(tmp_path / "draft", target_config(target), None, "cpu", torch.float32)


def test_files_follow_the_documented_names(target: Path, tmp_path: Path) -> None:
    make_random_draft(tmp_path / "draft", target, 2)
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert raw["architecture"] == DRAFT_ARCHITECTURE
    assert raw["num_draft_steps"] == 2
    assert raw["spec_hidden_size"] == raw["hidden_size"] == 64
    assert raw["target"] == {
        "model": "target",
        "hidden_size": 64,
        "vocab_size": 320,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
    }
    names = set(load_file(str(tmp_path / "draft" / "model.safetensors")))
    expected = set()
    for d in range(2):
        expected |= {f"depths.{d}.{n}" for n in ("enorm.weight", "hnorm.weight", "fc.weight")}
        expected |= {f"depths.{d}.layer.{n}" for n in LAYER_NAMES}
    assert names == expected


def test_fewer_steps_than_the_draft_has(target: Path, tmp_path: Path) -> None:
    # More steps than depths: tests/test_reused_depth.py.
    make_random_draft(tmp_path / "draft", target, 4)
    draft = load_draft(tmp_path / "draft", target_config(target), 2, "cpu", torch.float32)
    assert draft.num_draft_steps == 2


@pytest.mark.parametrize(
    ("overrides", "field", "draft_value", "target_value"),
    [
        (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2), "hidden_size", 64, 96),
        (dict(vocab_size=400), "vocab_size", 320, 400),
        (dict(num_key_value_heads=4), "num_key_value_heads", 2, 4),
        (dict(intermediate_size=256), "intermediate_size", 128, 256),
    ],
)
def test_a_draft_for_another_target_is_refused_naming_both_values(
    target: Path, tmp_path: Path, overrides, field, draft_value, target_value
) -> None:
    make_random_draft(tmp_path / "draft", target, 2)
    other = tmp_path / "other"
    make_tiny_llama(other, seed=0, **overrides)
    with pytest.raises(DraftMismatchError) as error:
        LLM(
            str(other),
            device="cpu",
            kv_cache_tokens=256,
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(tmp_path / "draft"),
        )
    message = str(error.value)
    assert f"{field}: draft {draft_value}, target {target_value}" in message


def test_a_spec_hidden_size_mismatch_is_refused_naming_both_values(
    target: Path, tmp_path: Path
) -> None:
    make_random_draft(tmp_path / "draft", target, 1)
    config_file = tmp_path / "draft" / "config.json"
    raw = json.loads(config_file.read_text())
    raw["spec_hidden_size"] = 128  # as for a target that widens its residual stream 2x
    config_file.write_text(json.dumps(raw))
    with pytest.raises(DraftMismatchError, match="spec_hidden_size: draft 128, target 64"):
        load_draft(tmp_path / "draft", target_config(target), None, "cpu", torch.float32)


def test_broken_folders_are_refused(target: Path, tmp_path: Path) -> None:
    config = target_config(target)
    draft = make_random_draft(tmp_path / "draft", target, 2)
    weights = draft / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["depths.1.layer.self_attn.k_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="lacks 1 weights.*depths.1.layer.self_attn.k_proj"):
        load_draft(draft, config, None, "cpu", torch.float32)

    tensors["depths.1.layer.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["depths.0.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="unexpected weight 'depths.0.extra.weight'"):
        load_draft(draft, config, None, "cpu", torch.float32)

    del tensors["depths.0.extra.weight"]
    tensors["depths.0.fc.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match=r"depths.0.fc.weight.*\(64, 64\).*\(64, 128\)"):
        load_draft(draft, config, None, "cpu", torch.float32)

    (draft / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    with pytest.raises(ModelLoadError, match="not a draft model"):
        load_draft(draft, config, None, "cpu", torch.float32)


def test_engine_options_are_checked(target: Path, tmp_path: Path) -> None:
    draft = make_random_draft(tmp_path / "draft", target, 1)
    with pytest.raises(ValueError, match="unknown speculative_algorithm 'eagle9'.*multi-layer"):
        LLM(
            str(target),
            device="cpu",
            kv_cache_tokens=64,
            speculative_algorithm="eagle9",
            draft_model=str(draft),
        )
    with pytest.raises(ValueError, match="needs a draft_model"):
        LLM(
            str(target), device="cpu", kv_cache_tokens=64, speculative_algorithm="multi-layer-eagle"
        )
    with pytest.raises(ValueError, match="need a speculative_algorithm"):
        LLM(str(target), device="cpu", kv_cache_tokens=64, draft_model=str(draft))


def test_engine_does_not_import_spec() -> None:
    """spec depends on engine, never the reverse: importing the engine loads no spec module."""
    import subprocess
    import sys

    code = "import sys, engine, engine.llm, engine.engine_core; print('spec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
