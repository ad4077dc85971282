"""Which draft an engine speculates with: an explicit draft folder, else the shipped draft for
the default model (16-bit, at most 32 MB, fitting the embedded model), else none, and a clear
error for another model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import spec.default_draft as default_draft
from engine import LLM
from engine.loading.loader import EngineArgs, resolve
from spec import load_draft, resolve_draft_model


def test_an_explicit_draft_wins() -> None:
    assert resolve_draft_model("some/model", "my/draft") == "my/draft"
    assert resolve_draft_model(None, Path("my/draft")) == "my/draft"


def test_the_default_model_gets_the_shipped_draft() -> None:
    shipped = default_draft.DEFAULT_DRAFT_DIR
    if not (shipped / "model.safetensors").exists():
        pytest.skip("the package was installed without the shipped draft")
    assert default_draft.default_draft_path() == shipped
    assert resolve_draft_model(None, None) == str(shipped)


def test_the_shipped_draft_fits_the_embedded_model() -> None:
    """What the issue asks of the shipped weights: 16-bit, at most 32 MB, K >= 3, loadable
    against the default model; and a vocabulary that can end a turn."""
    shipped = default_draft.default_draft_path()
    if shipped is None:
        pytest.skip("the package was installed without the shipped draft")
    weights = shipped / "model.safetensors"
    assert weights.stat().st_size <= 32 * 10**6
    # The target's config as an engine speculating on the default model resolves it: with the
    # layers the shipped draft's depth 0 reads.
    args = EngineArgs(device="cpu", speculative_algorithm="multi-layer-eagle")
    target = resolve(args).model_config
    draft = load_draft(shipped, target, None, "cpu", torch.float32)
    assert draft.num_draft_steps >= 3
    dtypes = {t.dtype for name, t in load_file(str(weights)).items() if name != "draft_vocab"}
    assert dtypes <= {torch.bfloat16, torch.float16}
    assert draft.vocab is not None
    assert set(target.eos_token_ids) <= set(draft.vocab.tolist())


def test_no_draft_without_a_shipped_one(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(default_draft, "DEFAULT_DRAFT_DIR", tmp_path)  # no weights there
    assert default_draft.default_draft_path() is None
    assert resolve_draft_model(None, None) is None


def test_another_model_needs_a_trained_draft(tiny_model_path: Path) -> None:
    assert resolve_draft_model(str(tiny_model_path), None) is None
    with pytest.raises(ValueError, match="train-draft"):
        LLM(str(tiny_model_path), device="cpu", speculative_algorithm="multi-layer-eagle")
