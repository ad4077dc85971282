"""How a Llama-family model splits over tensor parallel ranks, checked once, and the slice of
each checkpoint tensor that one rank loads.

Rank r holds the query heads [r * H/N, (r + 1) * H/N), the MLP's intermediate features
[r * I/N, (r + 1) * I/N) and the vocabulary rows [r * V', (r + 1) * V') with V' = ceil(V/N) (the
last rank's rows past V are zeros, and their logits are dropped after the gather). KV heads are
split like the query heads where N divides them; where there are fewer KV heads than ranks, each
is replicated on the N/Hkv consecutive ranks whose query heads read it, so a rank always holds
exactly the KV heads its own queries attend with and its KV pool stores only those."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from engine.errors import TensorParallelError
from engine.model_config import ModelConfig
from engine.tensor_parallel.kv_routes import KVHeads


@dataclass(frozen=True)
class TensorParallelLayout:
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, size: int) -> TensorParallelLayout:
        """The layout of `config` over `size` ranks; TensorParallelError naming the mismatch
        where the model cannot be split that way."""
        check_tensor_parallel(config, size)
        return cls(
            size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
        )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> KVHeads:
        return KVHeads(self.size, self.num_kv_heads)

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads.local

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1: split, not replicated)."""
        return self.kv_heads.replicas

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab_size // self.size)

    def first_kv_head(self, rank: int) -> int:
        return self.kv_heads.first(rank)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """What one rank's model is built from: its heads, MLP features and vocabulary rows."""
        return dataclasses.replace(
            config,
            num_heads=self.local_heads,
            num_kv_heads=self.local_kv_heads,
            intermediate_size=self.local_intermediate,
            vocab_size=self.vocab_shard,
        )

    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], rank: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (HF name, tensor) pairs as rank `rank` loads them: each tensor
        sliced to the rank's part as it streams past, so no rank keeps a whole weight."""
        for name, tensor in weights:
            yield name, self.shard_tensor(name, tensor, rank)

    def shard_tensor(self, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        d = self.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab_rows(tensor, rank)
        if ".q_proj." in name:
            return _rows(tensor, rank * self.local_heads * d, self.local_heads * d)
        if ".k_proj." in name or ".v_proj." in name:
            width = self.local_kv_heads * d
            return _rows(tensor, self.first_kv_head(rank) * d, width)
        if ".gate_proj." in name or ".up_proj." in name:
            width = self.local_intermediate
            return _rows(tensor, rank * width, width)
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            width = tensor.shape[1] // self.size
            return tensor[:, rank * width : (rank + 1) * width].contiguous()
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            # The partial outputs are summed across ranks: the bias joins the sum once.
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return tensor

    def _vocab_rows(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        shard = self.vocab_shard
        rows = tensor[rank * shard : (rank + 1) * shard]
        if rows.shape[0] == shard:
            return rows.contiguous()
        padded = tensor.new_zeros((shard, *tensor.shape[1:]))
        padded[: rows.shape[0]] = rows
        return padded


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[start : start + count].contiguous()


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse (TensorParallelError) a model that `size` ranks cannot split, naming why."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if config.moe is not None:
        raise TensorParallelError(
            f"tensor_parallel_size={size}: mixture-of-experts layers ({config.architecture}) "
            "are not sharded"
        )
    if config.hc_mult != 1:
        raise TensorParallelError(
            f"tensor_parallel_size={size}: hyper-connection models (hc_mult={config.hc_mult}) "
            "are not sharded"
        )
    if config.num_heads % size:
        raise TensorParallelError(
            f"tensor_parallel_size={size} does not divide the attention heads "
            f"(num_attention_heads={config.num_heads})"
        )
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise TensorParallelError(
            f"tensor_parallel_size={size} neither divides the KV heads "
            f"(num_key_value_heads={kv}) nor is a multiple of them (to replicate each)"
        )
    if config.intermediate_size % size:
        raise TensorParallelError(
            f"tensor_parallel_size={size} does not divide the MLP's intermediate size "
            f"(intermediate_size={config.intermediate_size})"
        )


def check_tensor_parallel_options(size: int, device: str) -> None:
    """Refuse (TensorParallelError) engine options that tensor parallelism does not run with."""
    if size == 1:
        return
    if torch.device(device).type != "cpu":
        raise TensorParallelError(
            f"tensor_parallel_size={size} runs on CPU (gloo) only so far, not on {device!r}"
        )
