"""A minimal hyper-connection Llama ("HyperLlamaForCausalLM", model_type "hyper_llama"): a Llama
whose residual stream is `hc_mult` copies of the hidden state, [T, hc_mult, hidden], instead of
one. It exists so that a target whose draft input is wider than `hidden_size`
(`spec_hidden_size = hidden_size * hc_mult`) can be built, tested and served.

Static hyper-connections, one around each sublayer (s = 0: attention, s = 1: MLP) of layer l:

    x = sum_j hc_read[s, j] * stream[:, j]          # the sublayer's input: a learned mix
    stream[:, j] += hc_write[s, j] * sublayer(x)    # its output, weighted per copy

The embedding starts every copy; the LM head reads the final norm of sum_j hc_head[j] *
stream[:, j]. The draft reads the whole stream, flattened to [T, hc_mult * hidden]. With
hc_mult = 1 and every weight 1 this is the plain Llama, bit for bit.

Checkpoint names: the Llama's, plus `model.layers.{l}.hc_read` and `model.layers.{l}.hc_write`
([2, hc_mult] each) and `model.hc_head` ([hc_mult]); config.json carries `hc_mult`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.executor.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.rope import RotaryEmbedding


def mix_copies(stream: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[j] * stream[:, j]: [T, hc_mult, hidden], [hc_mult] -> [T, hidden]."""
    return (stream * weights[:, None]).sum(dim=1)


class HyperDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.hc_read = nn.Parameter(torch.ones(2, config.hc_mult))
        self.hc_write = nn.Parameter(torch.ones(2, config.hc_mult))

    def forward(
        self,
        stream: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(mix_copies(stream, self.hc_read[0])), batch, rotary, backend
        )
        stream = stream + self.hc_write[0][:, None] * attn[:, None]
        mlp = self.mlp(self.post_attention_layernorm(mix_copies(stream, self.hc_read[1])))
        return stream + self.hc_write[1][:, None] * mlp[:, None]


class HyperLlamaForCausalLM(LlamaForCausalLM):
    """`forward` returns the residual stream flattened, [T, hc_mult * hidden] (the draft's
    input); `compute_logits` mixes its copies and applies the final norm and the LM head."""

    layer_class = HyperDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.hc_head = nn.Parameter(torch.ones(config.hc_mult) / config.hc_mult)

    def forward_layers(
        self,
        batch: ForwardBatch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The flattened stream after the last layer, and after each layer in `aux_layers`."""
        embeds = self.embed(batch)
        cos_sin = rotary.lookup(batch.positions, embeds.dtype)
        stream = embeds[:, None].expand(-1, self.config.hc_mult, -1)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            stream = layer(stream, batch, cos_sin, backend)
            if i in aux_layers:
                captured[i] = stream.flatten(1)
        return stream.flatten(1), [captured[i] for i in aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        stream = hidden.unflatten(-1, (self.config.hc_mult, self.config.hidden_size))
        return self.lm_head_logits(mix_copies(stream, self.model.hc_head))
