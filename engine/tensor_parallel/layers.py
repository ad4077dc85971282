"""The layers that make a Llama-family model tensor parallel, wrapped around the model's own
modules once its sharded weights are loaded (and packed), so the model code stays one.

Built from `TensorParallelLayout.local_config`, each rank's model already holds column-parallel
projections (its rows of q/k/v and gate/up, which need no communication); what is left is where
the partial results meet: the row-parallel outputs (o_proj, down_proj: each rank's product over
its own inputs, summed across ranks), the vocabulary-parallel embedding (each rank looks up the
ids in its rows, zeros elsewhere, summed) and the LM head (each rank's logits over its rows,
gathered side by side and cut to the vocabulary)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.tensor_parallel.group import RankGroup
from engine.tensor_parallel.layout import TensorParallelLayout


class RowParallel(nn.Module):
    """A projection whose input features are split across ranks: the sum of every rank's
    product. Its bias (rank 0's alone, see TensorParallelLayout.shard_tensor) joins once."""

    def __init__(self, linear: nn.Module, group: RankGroup) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x).contiguous()
        self.group.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split across ranks: each looks up the ids in its rows."""

    def __init__(self, embedding: nn.Embedding, first_row: int, group: RankGroup) -> None:
        super().__init__()
        self.embedding = embedding
        self.first_row = first_row
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_row
        rows = self.embedding.num_embeddings
        mine = (local >= 0) & (local < rows)
        out = self.embedding(local.clamp(0, rows - 1))
        out = torch.where(mine[..., None], out, torch.zeros((), dtype=out.dtype)).contiguous()
        self.group.all_reduce(out)
        return out


class GatheredLMHead(nn.Module):
    """An LM head whose vocabulary rows are split across ranks: every rank's logits side by
    side, cut to the vocabulary (the last rank's padding rows dropped). Every rank gets them;
    only rank 0 samples from them."""

    def __init__(self, head: nn.Module, vocab_size: int, group: RankGroup) -> None:
        super().__init__()
        self.head = head
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(self.head(hidden))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def parallelize(model: nn.Module, layout: TensorParallelLayout, group: RankGroup) -> None:
    """Wrap the loaded rank model's meeting points (see the module docstring), in place."""
    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding(
        inner.embed_tokens, group.rank * layout.vocab_shard, group
    )
    model.lm_head = GatheredLMHead(model.lm_head, layout.vocab_size, group)
    for layer in inner.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)


class ModelShard:
    """One rank's part of a tensor parallel model: what the runner builds its model, attention
    and KV pool from (`local_config`), the slice of the checkpoint it loads, and the wrapping
    that joins the ranks' partial results."""

    def __init__(self, layout: TensorParallelLayout, group: RankGroup) -> None:
        self.layout = layout
        self.group = group

    @property
    def rank(self) -> int:
        return self.group.rank

    def local_config(self, config: ModelConfig) -> ModelConfig:
        return self.layout.local_config(config)

    def weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.layout.shard_weights(weights, self.rank)

    def parallelize(self, model: nn.Module) -> None:
        parallelize(model, self.layout, self.group)
