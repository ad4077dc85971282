"""Building an engine: the one function that turns `EngineArgs` into a model on disk resolved, a
loaded runner, its speculator and the EngineCore that drives them, for `engine.LLM` and every
node kind (prefill, decode, aggregated).

The speculative algorithm comes in as a `Speculation` (engine/speculation.py): the nodes pass
spec's (spec/compose.py, the composition root above the engine), `LLM` the one it was given or
the one registered under its algorithm's name. The engine itself never imports spec."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.engine_core import EngineCore
from engine.engine_hooks import PrefillHandoff, Speculator
from engine.executor.debug_dump import OFFLINE_NODE
from engine.executor.model_runner import ModelRunner
from engine.loading.loader import EngineArgs, ModelSpec, load_runner, resolve
from engine.speculation import Speculation, chosen_speculation


@dataclass(frozen=True)
class BuiltEngine:
    """An engine as built: the model as resolved, and the EngineCore that owns its runner and
    speculator."""

    spec: ModelSpec
    core: EngineCore

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def speculator(self) -> Speculator | None:
        return self.core.speculator

    @property
    def num_draft_steps(self) -> int:
        return 0 if self.core.speculator is None else self.core.speculator.num_draft_steps


def build_engine(
    args: EngineArgs,
    speculation: Speculation | None = None,
    *,
    node_name: str = OFFLINE_NODE,
    decodes: bool = True,
    tracing: bool = False,
    handoff: PrefillHandoff | None = None,
    seed: int | None = None,
    prefix_cache: bool = True,
) -> BuiltEngine:
    """`speculation`: for args that speculate (by default the one registered under
    args.speculative_algorithm). `node_name` names the tensor dump folder. `decodes=False` (a
    prefill node) captures no decode graphs, which would cost start-up time and memory for
    nothing. `tracing`, `handoff`, `seed` and `prefix_cache` (False: none whatever the args)
    are EngineCore's."""
    speculation = chosen_speculation(args.speculative_algorithm, speculation)
    spec = resolve(args, node_name, speculation)
    if not decodes:
        config = dataclasses.replace(spec.engine_config, cuda_graph_max_bs=0)
        spec = dataclasses.replace(spec, engine_config=config)
    runner = load_runner(spec)
    speculator = None if speculation is None else speculation.speculator(args, runner)
    core = EngineCore(
        runner,
        spec.tokenizer,
        speculator,
        tracing=tracing,
        handoff=handoff,
        seed=seed,
        prefix_cache=prefix_cache,
    )
    return BuiltEngine(spec, core)
