"""Speculative decoding (multi-layer EAGLE): the draft layers, one DraftRunner per depth with
its own token pool and KV pool, the draft -> verify -> draft-extend loop, and the acceptance rules.

Entry points: `speculation_of` (spec/compose.py: what `engine.build.build_engine` takes to
build an engine's speculator; importing spec registers it for `engine.LLM`), and on the worker
the engine builds with it, `draft_extend_prefill` + `export_state` + `depth_kv` for a prefill
node, and `reserve` + `adopt`, then `verify` / `finish_round` (driven by EngineCore.step) for a
decode node.

Folders: spec/runtime (the worker, round plans, verify and acceptance, draft runners and
extends, draft trees, per-request state), spec/train (`pdcluster train-draft`), spec/drafts
(the shipped draft); here, the composition root, the draft model and its config.
"""

from __future__ import annotations

from spec.compose import ALGORITHMS, build_speculator, speculation_of
from spec.config import DraftConfig, DraftMismatchError, draft_target_config
from spec.default_draft import default_draft_path, resolve_draft_model
from spec.draft_model import MultiLayerEagleDraft, load_draft, save_draft
from spec.runtime.state import DraftState
from spec.runtime.worker import MultiLayerEagleWorker

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
    "speculation_of",
    "load_draft",
    "save_draft",
]
