"""The draft shipped with the package for the embedded default model (SmolLM2-135M-Instruct),
trained by `pdcluster train-draft` (docs/training.md): an engine on the default model that is
asked to speculate without a draft folder uses it."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct"


def default_draft_path() -> Path | None:
    """The shipped draft's folder, or None where the package was installed without it."""
    return DEFAULT_DRAFT_DIR if (DEFAULT_DRAFT_DIR / "model.safetensors").exists() else None


def resolve_draft_model(
    model: str | os.PathLike | None, draft_model: str | os.PathLike | None
) -> str | None:
    """The draft folder an engine speculating on `model` uses: `draft_model` when given, else
    the shipped draft for the default model (model None). None when there is neither; the
    speculator then refuses to start, saying a draft folder is needed."""
    if draft_model is not None:
        return str(draft_model)
    if model is None and (shipped := default_draft_path()) is not None:
        return str(shipped)
    return None
