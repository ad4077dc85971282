"""A follower rank's process: it loads its shard of the model, then runs every forward that rank 0
announces, until told to stop or until rank 0 is gone."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cpu_tuning import keep_large_allocations_in_heap
from engine.model_config import ModelConfig
from engine.tensor_parallel.forward_plan import Order, receive, run_announced
from engine.tensor_parallel.group import RankGroup, dial_store, joined_key
from engine.tensor_parallel.kv_links import KVLinks
from engine.tensor_parallel.layers import ModelShard
from engine.tensor_parallel.layout import TensorParallelLayout

# Exit status of a follower whose rank 0 went away.
ORPHANED = 3


@dataclass(frozen=True)
class RankStart:
    """What a follower process is started with (pickled once, by the spawn)."""

    rank: int
    size: int
    port: int
    model_path: Path
    model_config: ModelConfig
    engine_config: EngineConfig


def follow(start: RankStart) -> None:
    """The follower process's entry point."""
    _exit_with_parent()
    keep_large_allocations_in_heap()
    # The ranks share the host's cores; each takes its part rather than all of them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // start.size))
    store = dial_store(start.port, start.size)
    store.set(joined_key(start.rank), "1")
    group = RankGroup.join(store, start.rank, start.size)
    layout = TensorParallelLayout.of(start.model_config, start.size)
    # Imported here: engine.loading.loader imports this module (through the leader).
    from engine.loading.loader import load_rank_runner

    runner = load_rank_runner(
        start.model_path, start.model_config, start.engine_config, ModelShard(layout, group)
    )
    # This rank's channels to other nodes' ranks, for its KV heads of their transfers.
    links = KVLinks(runner.kv_pool)
    # Loaded: rank 0 waits for this before its first forward.
    group.all_reduce(torch.zeros(1))
    with torch.inference_mode():
        while (announced := receive(group, runner)).order != Order.STOP:
            run_announced(runner, announced, links)
    # Nothing here outlives the engine: skip the interpreter's teardown, which would keep
    # rank 0's close() waiting for seconds on a busy host.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """End this process as soon as rank 0's process ends, whatever this one is doing (loading
    weights, waiting for a forward): no rank outlives its engine."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(ORPHANED)

    threading.Thread(target=wait, name="tp-parent-watch", daemon=True).start()
