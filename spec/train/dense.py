"""Teacher-forced forwards over whole sequences, for training: the target's and every draft
depth's, through the very modules the engine runs, with plain causal attention over a padded
[B, T] batch in place of the paged KV cache (banded to the window in a sliding-window layer).

Sequences are padded at the end. Attention is causal, so padding never reaches a real position;
the loss masks the padded positions out."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend
from engine.executor.model_runner import run_target
from engine.models.llama import LlamaForCausalLM
from engine.models.rope import RotaryEmbedding
from spec.draft_model import MultiLayerEagleDraft


@dataclass
class DenseBatch:
    """What the model's embedding, rotary lookup and this backend read of a ForwardBatch, for a
    [B, T] block of tokens flattened to B*T."""

    input_ids: torch.Tensor  # [B*T]
    positions: torch.Tensor  # [B*T]: 0..T-1 in every row
    batch_size: int
    seq_len: int
    input_embeds: torch.Tensor | None = None
    input_embeds_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor) -> DenseBatch:
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).repeat(b)
        return cls(tokens.reshape(-1), positions, b, t)


class CausalAttention(AttentionBackend):
    """Every position attends to the positions before it in its own row, or in a layer of
    sliding-window attention to the last `window` of them; no KV cache."""

    supports_sliding_window = True

    def prepare(self, batch: DenseBatch) -> None:
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: DenseBatch,
        window: int | None = None,
    ) -> torch.Tensor:
        b, t = batch.batch_size, batch.seq_len

        def heads(x: torch.Tensor) -> torch.Tensor:  # [B*T, h, D] -> [B, h, T, D]
            return x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2)

        mask = None
        if window is not None:
            # A row's rotary positions are its indices, so engine.attention's rule (a query at
            # p sees the positions above p - window) reads as a band under the diagonal.
            index = torch.arange(t, device=q.device)
            steps_back = index[:, None] - index
            mask = (steps_back >= 0) & (steps_back < window)
        out = F.scaled_dot_product_attention(
            heads(q),
            heads(k),
            heads(v),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(b * t, self.num_heads, self.head_dim)


def attention_for(model: LlamaForCausalLM) -> CausalAttention:
    config = model.config
    return CausalAttention(config.num_heads, config.num_kv_heads, config.head_dim)


@torch.no_grad()
def target_forward(
    target: LlamaForCausalLM, rotary: RotaryEmbedding, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over [B, T] tokens: the hidden state the draft reads at every position
    [B*T, spec_hidden_size], and what the LM head reads [B*T, ...] (see run_target)."""
    batch = DenseBatch.of(tokens)
    last, draft_hidden = run_target(target, batch, rotary, attention_for(target))
    return draft_hidden, last


def shifted(tokens: torch.Tensor, by: int, pad: int = 0) -> torch.Tensor:
    """[B, T] with row b's position i holding tokens[b, i + by] (`pad` past the end)."""
    out = torch.full_like(tokens, pad)
    if by < tokens.shape[1]:
        out[:, : tokens.shape[1] - by] = tokens[:, by:]
    return out


def draft_forward(
    draft: MultiLayerEagleDraft,
    target: LlamaForCausalLM,
    rotary: RotaryEmbedding,
    tokens: torch.Tensor,
    target_hidden: torch.Tensor,
    detach_between_depths: bool = False,
) -> list[torch.Tensor]:
    """Every depth's output [B*T, hidden_size] at every position, teacher-forced: depth d at
    position i reads token x[i+d+1] and depth d-1's output at i (the target's hidden state for
    d = 0), and predicts x[i+d+2], as spec.runtime.draft_extend aligns them at inference. With the
    target's own greedy tokens as `tokens`, depth d sees here exactly what it sees at decode
    time whenever depths < d drafted correctly."""
    batch = DenseBatch.of(tokens)
    backend = attention_for(target)
    weight = target.model.embed_tokens.weight
    cos_sin = rotary.lookup(batch.positions, weight.dtype)
    outputs = []
    hidden = target_hidden
    for d, depth in enumerate(draft.depths):
        # Embedding lookups outside the target's (maybe inference-mode) modules: a plain
        # function on its weight, so the draft's graph can be built on top.
        embeds = target.scale_embeddings(F.embedding(shifted(tokens, d + 1).reshape(-1), weight))
        out = depth(embeds, hidden, batch, cos_sin, backend)
        outputs.append(out)
        hidden = out.detach() if detach_between_depths else out
    return outputs
