"""The composition root of speculative engines: what binds the engine's `Speculation` seam
(engine/speculation.py) to the multi-layer EAGLE implementation here. Dependencies point one
way, engine <- spec <- nodes: the nodes build their engine with `engine.build.build_engine`
and the `Speculation` `speculation_of` gives them; the engine names no spec module.

`engine.LLM` finds the same `Speculation` by its algorithm's name instead (it lives in the
engine, which cannot import this module): importing spec registers it below, and an installed
pdcluster declares it as the `pdcluster.speculation` entry point `multi-layer-eagle`
(pyproject.toml), so `from engine import LLM` speculates in a process that never imported spec.
"""

from __future__ import annotations

import os

from engine.executor.model_runner import ModelRunner
from engine.loading.loader import EngineArgs, ModelSpec, resolve
from engine.model_config import ModelConfig
from engine.speculation import Speculation, chosen_speculation, register_speculation
from spec.config import draft_target_config
from spec.default_draft import resolve_draft_model
from spec.draft_model import load_draft
from spec.runtime.worker import MultiLayerEagleWorker

ALGORITHMS = ("multi-layer-eagle",)


def build_speculator(
    algorithm: str,
    runner: ModelRunner,
    draft_model: str | os.PathLike | None,
    num_draft_steps: int | None = None,
) -> MultiLayerEagleWorker:
    check_algorithm(algorithm)
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


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown speculative_algorithm {algorithm!r}; supported: {', '.join(ALGORITHMS)}"
        )


class MultiLayerEagle:
    """Multi-layer EAGLE (spec/runtime/worker.py) as an engine builds it: the target widened to the
    hidden states the draft reads, and a worker over the draft's depths."""

    def target_config(self, args: EngineArgs, target: ModelConfig) -> ModelConfig:
        return draft_target_config(target, resolve_draft_model(args.model, args.draft_model))

    def speculator(self, args: EngineArgs, runner: ModelRunner) -> MultiLayerEagleWorker:
        draft = resolve_draft_model(args.model, args.draft_model)
        return build_speculator(ALGORITHMS[0], runner, draft, args.num_draft_steps)


MULTI_LAYER_EAGLE = MultiLayerEagle()
register_speculation(ALGORITHMS[0], MULTI_LAYER_EAGLE)


def speculation_of(args: EngineArgs) -> Speculation | None:
    """The `Speculation` an engine built from `args` runs, as the engine's registry has it
    (this module registers multi-layer EAGLE above); None without speculation. ValueError
    naming the supported algorithms for another name."""
    return chosen_speculation(args.speculative_algorithm)


def resolve_model(args: EngineArgs) -> ModelSpec:
    """The model `args` name as an engine of theirs would build it (its `spec_hidden_size`
    included), without loading weights: for a driver that sizes and checks before the nodes
    start."""
    return resolve(args, speculation=speculation_of(args))
