"""Rank 0 of a tensor parallel engine: the runner the engine holds, which announces each forward
to the follower processes before running it on its own shard, and the followers' lifetime.

The rest of the engine (scheduler, sampling, grammar, penalties, detokenizing) sees one runner
whose logits are whole, exactly as with one rank: sampling happens on rank 0 only, from the
logits every rank gathered, so it is identical to one rank's by construction and needs no seed
kept in step across processes."""

from __future__ import annotations

import dataclasses
import weakref
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.errors import RankFailedError
from engine.executor.forward_batch import ForwardBatch
from engine.executor.model_runner import ForwardOutput, ModelRunner
from engine.loading.weights import iter_safetensors
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.sampling.verify_outputs import VerifyOutputs
from engine.tensor_parallel.follower import RankStart, follow
from engine.tensor_parallel.forward_plan import Order, announce, announce_stop
from engine.tensor_parallel.group import RankGroup, host_store, joined_key
from engine.tensor_parallel.kv_links import KVLinks
from engine.tensor_parallel.layers import ModelShard
from engine.tensor_parallel.layout import TensorParallelLayout
from engine.tensor_parallel.link_orders import (
    LinkOrder,
    RankStatus,
    gather_status,
    gathers_status,
    run_link_order,
)
from engine.tensor_parallel.whole_vocabulary import load_vocabulary_model

# How long a follower gets to leave after the stop order before it is terminated.
STOP_GRACE_S = 10.0
# How long a follower that failed a collective gets to finish exiting, so that the error can
# name it (its traceback may still be printing).
EXIT_WAIT_S = 2.0
# How often rank 0 checks, while followers start, that none has died.
JOIN_POLL_S = 0.05


class Followers:
    """Ranks 1..N-1: their processes and the group rank 0 shares with them."""

    def __init__(self, group: RankGroup, processes: list[BaseProcess], store: dist.Store) -> None:
        self.group = group
        self.processes = processes
        self.store = store  # the group's rendezvous; kept for the group's lifetime

    def failure(self) -> RankFailedError | None:
        """The error naming the first follower that has exited, if one has."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=EXIT_WAIT_S if process.is_alive() else 0)
            if process.exitcode is not None:
                return RankFailedError(
                    f"tensor parallel rank {rank} exited (exit code {process.exitcode})"
                )
        return None

    def stop(self) -> None:
        """Tell every follower to stop and wait for it; terminate any that does not leave.
        With a rank gone the group is broken: the others cannot hear the order, and are
        terminated at once."""
        grace = 0.0
        if all(p.is_alive() for p in self.processes):
            try:
                announce_stop(self.group)
                grace = STOP_GRACE_S
            except RuntimeError:
                pass
        end_processes(self.processes, grace)


def end_processes(processes: list[BaseProcess], grace: float = 0.0) -> None:
    """Wait up to `grace` seconds for each process to leave, then terminate, then kill."""
    for process in processes:
        process.join(timeout=grace)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner: every forward is announced to the followers, then run here."""

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        model_path: Path,
        shard: ModelShard,
        followers: Followers,
    ) -> None:
        super().__init__(model_config, engine_config, iter_safetensors(model_path), shard)
        self.followers = followers
        self._model_path = model_path
        self._vocabulary_model: LlamaForCausalLM | None = None
        # Runs once: on close(), when the runner is collected, or at interpreter exit.
        self._stop = weakref.finalize(self, followers.stop)

    def vocabulary_model(self) -> LlamaForCausalLM:
        """Rank 0's whole embedding, final norm and LM head (engine.tensor_parallel.
        whole_vocabulary), loaded the first time a draft asks."""
        if self._vocabulary_model is None:
            self._vocabulary_model = load_vocabulary_model(
                self._model_path, self.model_config, self.config
            )
        return self._vocabulary_model

    def forward(self, batch: ForwardBatch, keep_hidden: bool = False) -> ForwardOutput:
        self._refuse_closed()
        try:
            announce(self.followers.group, Order.FORWARD, batch, keep_hidden)
            return super().forward(batch, keep_hidden)
        except RuntimeError as err:
            self._raise_rank_failure(err)
            raise

    def forward_every_token(self, batch: ForwardBatch) -> VerifyOutputs:
        self._refuse_closed()
        try:
            announce(self.followers.group, Order.EVERY_TOKEN, batch)
            return super().forward_every_token(batch)
        except RuntimeError as err:
            self._raise_rank_failure(err)
            raise

    def run_link_order(self, order: LinkOrder, links: KVLinks) -> list[RankStatus]:
        """Every rank does `order` on its own links (engine/tensor_parallel/link_orders.py),
        this one on `links`; their statuses where the order gathers them (a rank's failure
        among them, the ranks still in step), else rank 0's."""
        self._refuse_closed()
        group = self.followers.group
        try:
            order.announce(group)
            status = run_link_order(links, order, 0)
            if gathers_status(order):
                return gather_status(group, status)
            return [status]
        except RuntimeError as err:
            self._raise_rank_failure(err)
            raise

    def lost_rank(self) -> str | None:
        for rank, process in enumerate(self.followers.processes, start=1):
            if not process.is_alive():
                return f"tensor parallel rank {rank} exited (exit code {process.exitcode})"
        return None

    def _refuse_closed(self) -> None:
        if not self._stop.alive:
            raise RankFailedError("this tensor parallel engine was closed")

    def _raise_rank_failure(self, err: RuntimeError) -> None:
        """A failed collective: the error naming the rank that is gone, if one is."""
        failure = self.followers.failure()
        if failure is not None:
            raise failure from err

    def close(self) -> None:
        self._stop()


def start_tensor_parallel(
    model_path: Path, model_config: ModelConfig, engine_config: EngineConfig
) -> TensorParallelRunner:
    """Start ranks 1..N-1 (one spawned process each), form the group with them on a loopback
    port the OS picks, and load rank 0's shard while they load theirs."""
    size = engine_config.tensor_parallel_size
    layout = TensorParallelLayout.of(model_config, size)
    store = host_store(size)
    configs = {rank: _rank_config(engine_config, rank) for rank in range(1, size)}
    context = mp.get_context("spawn")
    processes = [
        context.Process(
            target=follow,
            args=(RankStart(rank, size, store.port, model_path, model_config, configs[rank]),),
            name=f"pdcluster-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
    try:
        _wait_until_joined(store, processes)
        group = RankGroup.join(store, 0, size)
        followers = Followers(group, processes, store)
        runner = TensorParallelRunner(
            model_config,
            engine_config,
            model_path,
            ModelShard(layout, group),
            followers,
        )
        try:
            group.all_reduce(torch.zeros(1))  # every follower has loaded its shard
        except RuntimeError as err:
            raise (followers.failure() or err) from err
    except BaseException:
        end_processes(processes)
        raise
    return runner


def _wait_until_joined(store: dist.TCPStore, processes: list[BaseProcess]) -> None:
    """Wait for each follower to reach the store, failing as soon as one has died (forming the
    group would otherwise wait out the store's timeout)."""
    for rank, process in enumerate(processes, start=1):
        while not store.check([joined_key(rank)]):
            if not process.is_alive():
                raise RankFailedError(
                    f"tensor parallel rank {rank} exited (exit code {process.exitcode}) "
                    "before joining"
                )
            process.join(timeout=JOIN_POLL_S)


def _rank_config(engine_config: EngineConfig, rank: int) -> EngineConfig:
    """A follower's engine config: rank 0's, its tensor dump (if any) in a folder of its own."""
    dump = engine_config.tensor_dump
    if dump is None:
        return engine_config
    return dataclasses.replace(engine_config, tensor_dump=dataclasses.replace(dump, rank=rank))
