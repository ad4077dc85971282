"""What an engine's scheduling is built with, from its config: its prefix cache (or none),
and how many tokens a mixed step may run."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.engine_hooks import Speculator
from engine.scheduling.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


def make_prefix_cache(
    config: EngineConfig, speculator: Speculator | None, wanted: bool
) -> PrefixCache | None:
    """The engine's prefix cache, or None. A speculating engine needs its speculator to cache
    the draft depths' KV beside the target's (`Speculator.prefix_companion`): a hit needs every
    depth's KV of the prefix too."""
    if not (config.enable_prefix_cache and wanted):
        return None
    if speculator is not None and speculator.prefix_companion() is None:
        log.info("prefix cache off: this engine's speculator cannot cache its draft KV")
        return None
    return PrefixCache()


def mixed_step_tokens(config: EngineConfig) -> int | None:
    """The most tokens a mixed step may run (engine.scheduling.scheduler): where decode steps replay
    CUDA graphs, only a step that a prefill graph replays (0 where none is captured); elsewhere
    max_prefill_tokens alone bounds it (None). On a GPU an eager forward costs 13 to 16 ms of host
    dispatch whatever its size, a graph-run decode step about 2: mixed at every admission, 1,024
    prompts through 256 seats (random SmolLM2-135M weights, H100) ran 170 eager mixed steps where
    separate steps ran 88 eager prefill steps, each admitting twice as many prompts. A step too
    large for a graph keeps what it was, a prefill step."""
    if not config.cuda_graph_max_bs:
        return None
    return config.cuda_graph_max_prefill_tokens
