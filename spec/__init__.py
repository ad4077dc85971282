"""Speculative decoding (multi-layer EAGLE): the draft layers, one DraftRunner per depth with
its own token pool and KV pool, the draft -> verify -> draft-extend loop, and the acceptance rules.

Entry points: `build_speculator` (an engine's speculator, by algorithm name), and on the worker
it returns, `draft_extend_prefill` + `export_state` + `depth_kv` for a prefill node, and
`reserve` + `adopt`, then `verify` / `finish_round` (driven by EngineCore.step) for a decode node.
"""

from __future__ import annotations

import os

from engine.loader import EngineArgs
from engine.model_runner import ModelRunner
from spec.config import DraftConfig, DraftMismatchError, draft_target_config
from spec.default_draft import default_draft_path, resolve_draft_model
from spec.draft_model import MultiLayerEagleDraft, load_draft, save_draft
from spec.state import DraftState
from spec.worker import MultiLayerEagleWorker

ALGORITHMS = ("multi-layer-eagle",)


def build_speculator(
    algorithm: str,
    runner: ModelRunner,
    draft_model: str | os.PathLike | None,
    num_draft_steps: int | None = None,
) -> MultiLayerEagleWorker:
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown speculative_algorithm {algorithm!r}; supported: {', '.join(ALGORITHMS)}"
        )
    if draft_model is None:
        raise ValueError(
            f"speculative_algorithm={algorithm!r} needs a draft_model folder (a draft is shipped "
            "for the default model only; `pdcluster train-draft` makes one for another)"
        )
    config = runner.config
    draft = load_draft(
        draft_model, runner.model_config, num_draft_steps, config.device, config.dtype
    )
    if config.draft_vocab == "full":
        # The depths were trained against the whole head; a shipped vocabulary only narrows
        # what they may propose, to save the head's other rows.
        draft.vocab = None
    return MultiLayerEagleWorker(runner, draft)


def speculator_from_args(args: EngineArgs, runner: ModelRunner) -> MultiLayerEagleWorker | None:
    """The speculator an engine built from `args` uses, or None without speculation."""
    if args.speculative_algorithm is None:
        return None
    draft = resolve_draft_model(args.model, args.draft_model)
    return build_speculator(args.speculative_algorithm, runner, draft, args.num_draft_steps)


__all__ = [
    "ALGORITHMS",
    "DraftConfig",
    "DraftMismatchError",
    "DraftState",
    "MultiLayerEagleDraft",
    "MultiLayerEagleWorker",
    "build_speculator",
    "default_draft_path",
    "resolve_draft_model",
    "draft_target_config",
    "speculator_from_args",
    "load_draft",
    "save_draft",
]
