"""How an engine gets its speculative decoding without importing it: a `Speculation` per
algorithm name (`EngineArgs.speculative_algorithm`), given to `engine.build.build_engine` by
whoever composes the engine, or found here by name.

spec/ depends on engine/, so no module of the engine imports spec (tests/test_engine_imports.py
checks it). The implementations reach this registry from above, two ways:
- a package registers its algorithms when it is imported (spec/compose.py registers
  "multi-layer-eagle"), which covers every process that loaded spec, the nodes included;
- an installed distribution declares them under the `pdcluster.speculation` entry-point group
  (pyproject.toml), which the registry loads for a name nobody registered, so that a script that
  imports only the engine (`from engine import LLM`) can speculate.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.engine_hooks import Speculator
    from engine.executor.model_runner import ModelRunner
    from engine.loading.loader import EngineArgs
    from engine.model_config import ModelConfig

ENTRY_POINT_GROUP = "pdcluster.speculation"


class Speculation(Protocol):
    """One speculative algorithm as the engine builds it."""

    def target_config(self, args: EngineArgs, target: ModelConfig) -> ModelConfig:
        """`target` as the engine must build it for this algorithm's drafts (the hidden states
        they read decide `spec_hidden_size`), before any weights load."""

    def speculator(self, args: EngineArgs, runner: ModelRunner) -> Speculator:
        """The speculator of an engine whose target `runner` holds."""


_registered: dict[str, Speculation] = {}


def register_speculation(algorithm: str, speculation: Speculation) -> None:
    _registered[algorithm] = speculation


def registered_speculation(algorithm: str) -> Speculation:
    """The registered `Speculation` for `algorithm`, loading a declared entry point if no one
    registered it; ValueError naming the supported algorithms otherwise."""
    if algorithm not in _registered:
        for entry in entry_points(group=ENTRY_POINT_GROUP, name=algorithm):
            _registered[algorithm] = entry.load()
    if algorithm in _registered:
        return _registered[algorithm]
    declared = {entry.name for entry in entry_points(group=ENTRY_POINT_GROUP)}
    supported = ", ".join(sorted(declared | set(_registered))) or (
        "none (spec registers multi-layer-eagle when imported, or when pdcluster is installed)"
    )
    raise ValueError(f"unknown speculative_algorithm {algorithm!r}; supported: {supported}")


def chosen_speculation(
    algorithm: str | None, given: Speculation | None = None
) -> Speculation | None:
    """The `Speculation` an engine of `algorithm` runs: `given`, else the registered one; None
    for an engine that does not speculate (which refuses to be given one)."""
    if algorithm is None:
        if given is not None:
            raise ValueError("a Speculation was given to an engine without speculative_algorithm")
        return None
    return given if given is not None else registered_speculation(algorithm)
