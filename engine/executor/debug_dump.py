"""`--debug-tensor-dump-dir`: every module's output, one file per forward pass, for debugging.

Each writer (one node, one role: the target or one draft depth, one tensor parallel rank) owns
one folder, `DIR/<node>/<role>/rank<r>/`, and numbers its files with its own forward counter
(`forward_000042.pt`), so no two writers ever share a path. A file is a dict of CPU tensors,
written with `torch.save` and readable with `torch.load(path, weights_only=True)`:

- `input_ids`, `positions` [T]; `seq_lens`, `extend_lens` [B] (split the T rows per request);
- `input_embeds` [T, hidden] and `input_embeds_mask` [T] when the batch gave embeddings;
- `input_hidden` for a draft depth: the hidden state it read, [T, spec_hidden_size] at depth 0;
- `outputs`: {module name: its output}, e.g. `model.layers.0.mlp` for the target, `layer.mlp`
  for a draft depth. Decoder layers outside the layers filter are left out; everything else
  (embeddings, final norm, LM head, every part of a draft depth) is always there.

The dump relies on forward hooks, which run in eager mode only: a replayed CUDA graph skips
them, so the engine must never capture graphs while dumping (`refuse_cuda_graphs`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.executor.forward_batch import ForwardBatch

OFFLINE_NODE = "offline"  # the node name of engine.LLM, which is not part of a cluster
TARGET_ROLE = "target"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def draft_role(depth: int) -> str:
    return f"draft-{depth}"


@dataclass(frozen=True)
class TensorDumpConfig:
    """Where one engine instance dumps (`root`/`node`/<role>/rank<rank>) and which target
    decoder layers it keeps (None: all). A tensor parallel rank dumps its own shard's
    activations into its own folder (the draft runs on rank 0 alone)."""

    root: str
    node: str
    layers: tuple[int, ...] | None = None
    rank: int = 0

    def folder(self, role: str) -> Path:
        return Path(self.root) / self.node / role / f"rank{self.rank}"

    def keeps(self, module_name: str) -> bool:
        match = _LAYER_INDEX.search(module_name)
        return self.layers is None or match is None or int(match.group(1)) in self.layers


def tensor_dump_config(
    root: str | None, layers: tuple[int, ...] | None, node: str, num_layers: int
) -> TensorDumpConfig | None:
    """The dump settings of an engine named `node` over a target of `num_layers` layers, or
    None when not dumping; refuses layers the target does not have."""
    if root is None:
        return None
    outside = sorted(i for i in layers or () if not 0 <= i < num_layers)
    if outside:
        raise ValueError(
            f"debug_tensor_dump_layers {outside} outside the target's layers 0..{num_layers - 1}"
        )
    return TensorDumpConfig(root, node, tuple(layers) if layers is not None else None)


def refuse_cuda_graphs(dumping: bool, cuda_graphs: bool) -> None:
    """To be called wherever CUDA graphs get turned on: dumping needs eager mode."""
    if dumping and cuda_graphs:
        raise ValueError(
            "--debug-tensor-dump-dir needs eager mode: a replayed CUDA graph skips the forward "
            "hooks that record module outputs, so turn CUDA graphs off to dump"
        )


class TensorDumper:
    """Records the outputs of every module under `module` during `forward_pass`, and writes
    them as one file per pass into its own folder, which must hold no earlier dump."""

    def __init__(self, config: TensorDumpConfig, role: str, module: nn.Module) -> None:
        self.folder = config.folder(role)
        if self.folder.is_dir() and any(self.folder.glob("forward_*.pt")):
            raise ValueError(
                f"{self.folder} already holds a tensor dump; remove it or choose another "
                "--debug-tensor-dump-dir"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_passes = 0
        self._outputs: dict[str, torch.Tensor] | None = None  # None: outside a forward pass
        self._hooks = [
            child.register_forward_hook(self._recorder(name))
            for name, child in module.named_modules()
            if name and config.keeps(name)
        ]

    @contextmanager
    def forward_pass(self, batch: ForwardBatch, **inputs: torch.Tensor) -> Iterator[None]:
        """One forward pass of `batch`; `inputs`: what the module read beyond the batch."""
        assert self._outputs is None, "forward passes of one dumper do not nest"
        self._outputs = {}
        try:
            yield
            record: dict[str, Any] = {
                "input_ids": batch.input_ids,
                "positions": batch.positions,
                "seq_lens": torch.tensor(batch.seq_lens, dtype=torch.int64),
                "extend_lens": torch.tensor(batch.extend_lens, dtype=torch.int64),
                **inputs,
            }
            if batch.input_embeds is not None:
                record["input_embeds"] = batch.input_embeds[: batch.num_tokens]
                record["input_embeds_mask"] = batch.input_embeds_mask[: batch.num_tokens]
            record = {name: _to_cpu(value) for name, value in record.items()}
            record["outputs"] = self._outputs
            self._write(record)
        finally:
            self._outputs = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _recorder(self, name: str):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self._outputs is None:  # the module ran outside this role's forward pass
                return
            for key, tensor in _named_tensors(name, output):
                # A module that runs twice in one pass keeps both outputs.
                repeat, unique = 1, key
                while unique in self._outputs:
                    unique, repeat = f"{key}#{repeat}", repeat + 1
                self._outputs[unique] = _to_cpu(tensor)

        return record

    def _write(self, record: dict[str, Any]) -> None:
        path = self.folder / f"forward_{self.num_passes:06d}.pt"
        self.num_passes += 1
        # Written aside and renamed: a reader never sees half a file.
        partial = path.with_suffix(".partial")
        with open(partial, "xb") as file:
            torch.save(record, file)
        os.replace(partial, path)


def tensor_dumper(
    config: TensorDumpConfig | None, role: str, module: nn.Module
) -> TensorDumper | None:
    return None if config is None else TensorDumper(config, role, module)


def dump_pass(
    dumper: TensorDumper | None, batch: ForwardBatch, **inputs: torch.Tensor
) -> AbstractContextManager[None]:
    """`dumper.forward_pass(batch, ...)`, or nothing when not dumping."""
    return nullcontext() if dumper is None else dumper.forward_pass(batch, **inputs)


def _named_tensors(name: str, output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(output, torch.Tensor):
        yield name, output
    elif isinstance(output, tuple | list):
        for i, item in enumerate(output):
            yield from _named_tensors(f"{name}.{i}", item)


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    # A copy even on CPU: the engine may later write into the tensor it returned.
    return tensor.detach().to("cpu", copy=True)
