"""Llama-family decoder over a paged KV cache: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, tied or untied LM head. Weights load from HF names.

Qwen2, Qwen3 (dense) and Gemma 3 (text) are this decoder with options of ModelConfig: Qwen2 adds
biases to q, k and v (`qkv_bias`), which land in the packed QKV projection's bias; Qwen3 and
Gemma 3 normalise each query and key head with an RMSNorm of its own before the rotary embedding
(`qk_norm`: `q_norm` and `k_norm`, named as in their checkpoints). Gemma 3 also normalises each
sublayer's output before its residual add and gives the MLP an input norm of its own
(`sandwich_norms`: post_attention_layernorm then normalises the attention's output,
pre_feedforward_layernorm and post_feedforward_layernorm the MLP's input and output), applies
norm weights as 1 + w in float32 (`norm_unit_offset`), gates its MLP with tanh-approximated GELU,
scales token embeddings by sqrt(hidden_size), interleaves sliding-window layers (each with the
rotary embedding of its kind) with global ones, and may soft-cap its logits. Mixtral and Qwen3-MoE
replace the MLP of their sparse layers by a mixture of experts (engine.models.moe), its experts'
per-expert checkpoint tensors stacked into one tensor per projection at load time."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.errors import ModelLoadError
from engine.executor.forward_batch import ForwardBatch
from engine.kernels import triton_usable
from engine.model_config import ModelConfig
from engine.models.linear import Linear
from engine.models.moe import SparseMoeBlock, expert_weight_keys, moe_weight_slot, weight_key
from engine.models.rope import RotaryEmbedding


def observed(*modules: nn.Module) -> bool:
    """Whether anything hooks the forward of one of `modules` (a tensor dump, a test): such a
    module must run as a module call, not as a kernel that replaces it."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        """`unit_offset` (Gemma): the weight w is applied as 1 + w, and the product rounded to
        the model's dtype once, after it (the Llama norm rounds before multiplying)."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel rounds as the Llama norm does.
        if triton_usable(x) and not self.unit_offset:
            from engine.kernels.elementwise import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        # Normalize in float32 whatever the model dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), one kernel on a GPU."""
        if triton_usable(x) and not observed(self) and not self.unit_offset:
            from engine.kernels.elementwise import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        summed = residual + x
        return self(summed), summed


def rms_norm(config: ModelConfig, size: int) -> RMSNorm:
    """An RMSNorm of the model's kind over `size` features."""
    return RMSNorm(size, config.rms_norm_eps, config.norm_unit_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        # A sliding-window layer attends to its last `window` positions, and rotates with the
        # sliding layers' own embedding where they have one (column 1 of the rotary lookup).
        self.window = config.layer_window(layer)
        self.rotary_column = 1 if self.window is not None and config.rope.local else 0
        self.query_scale = config.query_scale
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.attention_bias or config.qkv_bias,
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = rms_norm(config, config.head_dim)
            self.k_norm = rms_norm(config, config.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        column = self.rotary_column
        cos, sin = rotary[0][:, column : column + 1], rotary[1][:, column : column + 1]
        out = backend.rotate_and_attend(q, k, v, cos, sin, self.layer, batch, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if triton_usable(gate_up):
            from engine.kernels.elementwise import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = SparseMoeBlock(config) if config.is_sparse_layer(layer) else MLP(config)
        self.input_layernorm = rms_norm(config, config.hidden_size)
        self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = rms_norm(config, config.hidden_size)

    @property
    def mlp_input_norm(self) -> RMSNorm:
        if self.pre_feedforward_layernorm is not None:
            return self.pre_feedforward_layernorm
        return self.post_attention_layernorm

    def attention_output(
        self,
        normed: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """What the attention adds to the residual stream: its output, normalised with
        sandwich norms."""
        attn = self.self_attn(normed, batch, rotary, backend)
        if self.pre_feedforward_layernorm is None:
            return attn
        return self.post_attention_layernorm(attn)

    def mlp_output(self, normed: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual stream."""
        out = self.mlp(normed)
        if self.post_feedforward_layernorm is None:
            return out
        return self.post_feedforward_layernorm(out)

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.attention_output(self.input_layernorm(hidden), batch, rotary, backend)
        normed, hidden = self.mlp_input_norm.add_and_norm(attn, hidden)
        return hidden + self.mlp_output(normed)

    def forward_deferred(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of delta + residual (residual alone when delta is None), returning its
        output as (mlp output, residual) unsummed: the next layer's first norm adds them in
        its own kernel, which rounds the sum where `forward`'s add does."""
        if delta is None:
            normed = self.input_layernorm(residual)
        else:
            normed, residual = self.input_layernorm.add_and_norm(delta, residual)
        attn = self.attention_output(normed, batch, rotary, backend)
        normed, residual = self.mlp_input_norm.add_and_norm(attn, residual)
        return self.mlp_output(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_class: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_layers))
        self.norm = rms_norm(config, config.hidden_size)


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`: a tensor times it rounds as times a 0-d tensor of `dtype`."""
    return torch.tensor(value, dtype=dtype).item()


class LlamaForCausalLM(nn.Module):
    """`forward` returns the last layer's hidden states [T, hidden] before the final norm;
    `compute_logits` applies the final norm and the LM head."""

    layer_class = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_class)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.scale_embeddings(self.model.embed_tokens(batch.input_ids))
        if batch.input_embeds is not None:
            mask = batch.input_embeds_mask[:, None]
            hidden = torch.where(mask, batch.input_embeds.to(hidden.dtype), hidden)
        return hidden

    def scale_embeddings(self, embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the layers read them: a family with `scaled_embeddings` (Gemma)
        multiplies them by sqrt(hidden_size) rounded to their dtype, as transformers does.
        Given input embeddings are not scaled."""
        if not self.config.scaled_embeddings:
            return embeds
        return embeds * _in_dtype(self.config.embed_scale, embeds.dtype)

    def forward(
        self, batch: ForwardBatch, rotary: RotaryEmbedding, backend: AttentionBackend
    ) -> torch.Tensor:
        return self.forward_layers(batch, rotary, backend)[0]

    def forward_layers(
        self,
        batch: ForwardBatch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The last layer's output, and the output of each layer in `aux_layers` (in that
        order): what an EAGLE3-style draft reads instead of the last layer's."""
        hidden = self.embed(batch)
        cos_sin = rotary.lookup(batch.positions, hidden.dtype)
        captured: dict[int, torch.Tensor] = {}
        layers = self.model.layers
        # A hooked norm runs as a module call inside `add_and_norm`; a hooked layer needs its
        # output whole, as does a layer class with a forward of its own.
        if self.layer_class.forward is not DecoderLayer.forward or observed(*layers):
            for i, layer in enumerate(layers):
                hidden = layer(hidden, batch, cos_sin, backend)
                if i in aux_layers:
                    captured[i] = hidden
            return hidden, [captured[i] for i in aux_layers]
        # A layer's closing residual add is the next one's first norm's (one kernel a layer
        # fewer); the sum is formed only where it is read.
        delta = None
        for i, layer in enumerate(layers):
            delta, hidden = layer.forward_deferred(delta, hidden, batch, cos_sin, backend)
            if i in aux_layers:
                captured[i] = hidden + delta
        if delta is not None:
            hidden = hidden + delta
        return hidden, [captured[i] for i in aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from what `forward` returns."""
        return self.lm_head_logits(hidden)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head over [.., hidden_size] states: the last layer's
        output here, a draft depth's output in speculative decoding."""
        return self.lm_head_outputs(hidden).float()

    def lm_head_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head_logits` in the model's dtype, for a caller that reads them once."""
        return self.cap_logits(self.lm_head(self.model.norm(hidden)))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap) where the family soft-caps its logits
        (`final_logit_softcapping`), for any head that computes logits of this model."""
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up into their packed projections and
        each expert's tensors into the stacked ones of its layer."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            slot = moe_weight_slot(name, self.config)
            if slot is None:
                (target, offset), expert = self._packed_target(name), None
            else:
                target, expert, offset = slot
            if target not in params:
                raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            rows = tensor.shape[0]
            dest = param.data if expert is None else param.data[expert]
            dest = dest if offset is None else dest.narrow(0, offset, rows)
            if dest.shape != tensor.shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(weight_key(target, expert, offset))
        expected = self._expected_keys(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}")

    def _packed_target(self, name: str) -> tuple[str, int | None]:
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        packed = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q),
            "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", inter),
        }
        for part, (fused, offset) in packed.items():
            if f".{part}." in name:
                return name.replace(part, fused), offset
        return name, None

    def _expected_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        keys = set()
        for name in params:
            experts = expert_weight_keys(name, c)
            if experts is not None:
                keys.update(experts)
            elif ".qkv_proj." in name:
                keys.update(f"{name}:{o}" for o in (0, q, q + kv))
            elif ".gate_up_proj." in name:
                keys.update(f"{name}:{o}" for o in (0, inter))
            elif not (name == "lm_head.weight" and c.tie_word_embeddings):
                keys.add(name)
        return keys
