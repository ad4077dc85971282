"""What a model is: the shapes and constants of a decoder (ModelConfig, with its rotary
embedding and its experts), read once from a HF config and frozen. How an engine runs a model is
engine.config's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    # The sliding-window layers' own rotary embedding (Gemma 3: another base, unscaled);
    # None: every layer rotates with this one.
    local: RopeConfig | None = None


# What a family's transformers code builds into every layer whatever its config says: the
# config has no field for these, so they come from the architecture.
FAMILY_LAYER_OPTIONS: dict[str, dict[str, bool]] = {
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
    "Gemma3ForCausalLM": {
        "qk_norm": True,
        "sandwich_norms": True,
        "norm_unit_offset": True,
        "scaled_embeddings": True,
    },
}
# The activations of the gated MLP, by their HF names.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP in the layers `sparse_layers` (the others keep the dense MLP):
    a router scores the `num_experts` experts of each token, a softmax in float32 turns the
    scores into probabilities, the token goes to its `top_k` likeliest experts with those
    probabilities as weights (divided by their sum when `renormalize`), and its output is the
    weighted sum of those experts' gated MLPs, each `intermediate_size` wide."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}"
            )
        if self.intermediate_size < 1:
            raise ValueError(f"expert intermediate_size must be >= 1, got {self.intermediate_size}")

    def weight_count(self, hidden_size: int) -> int:
        """Parameters of one sparse layer's MLP: the router and every expert."""
        return self.num_experts * (hidden_size + 3 * hidden_size * self.intermediate_size)


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a decoder of the Llama family (Llama, Mistral, Qwen2, Qwen3
    dense), of Gemma 3 (text), or of a mixture of experts on the same decoder (Mixtral,
    Qwen3-MoE), read once from a HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    # Biases on q, k, v and o (attention_bias), or on q, k and v only (qkv_bias, Qwen2).
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    # An RMSNorm over each query and key head before the rotary embedding (Qwen3, Gemma 3).
    qk_norm: bool = False
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma 3).
    hidden_act: str = "silu"
    # Gemma 3: each sublayer's output is normalised too before its residual add, the MLP's
    # input by a norm of its own (pre_feedforward_layernorm); every RMSNorm weight w is
    # applied as 1 + w, in float32; token embeddings are scaled by sqrt(hidden_size).
    sandwich_norms: bool = False
    norm_unit_offset: bool = False
    scaled_embeddings: bool = False
    # Attention over the last `sliding_window` positions (the query's own included) in the
    # layers `sliding_layers`; every other layer attends to the whole context.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Scores are q.k / sqrt(query_pre_attn_scalar) (Gemma); None: / sqrt(head_dim).
    query_pre_attn_scalar: float | None = None
    # Logits become cap * tanh(logits / cap) (Gemma); None: left as they are.
    final_logit_softcapping: float | None = None
    # The experts that replace the MLP of some layers (Mixtral, Qwen3-MoE); None: dense
    # layers only.
    moe: MoeConfig | None = None
    hc_mult: int = 1
    eos_token_ids: tuple[int, ...] = ()
    # The target layers whose outputs an EAGLE3-style draft reads, side by side, instead of
    # the last layer's; set by deriving this config for such a draft (spec.draft_target_config).
    draft_aux_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1, got {self.hc_mult}")
        outside = [i for i in self.draft_aux_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(
                f"draft_aux_layers {outside} outside the target's layers 0..{self.num_layers - 1}"
            )
        outside = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(
                f"sliding_layers {outside} outside the layers 0..{self.num_layers - 1}"
            )
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(
                f"sliding layers need a sliding_window >= 1, got {self.sliding_window}"
            )
        if self.moe is not None:
            outside = [i for i in self.moe.sparse_layers if not 0 <= i < self.num_layers]
            if outside:
                raise ValueError(
                    f"sparse layers {outside} outside the layers 0..{self.num_layers - 1}"
                )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act={self.hidden_act!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer` (the positions a query sees, its own included);
        None: the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def embed_scale(self) -> float:
        """What token embeddings are multiplied by (in the model's dtype, as transformers does)."""
        return self.hidden_size**0.5 if self.scaled_embeddings else 1.0

    @property
    def query_scale(self) -> float:
        """What queries are multiplied by before attention, whose scores the backends scale by
        1 / sqrt(head_dim): 1.0 unless query_pre_attn_scalar differs from head_dim."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    @property
    def spec_hidden_size(self) -> int:
        """Width of the hidden state handed to a draft model: the residual stream's full width
        (hidden_size * hc_mult), once per auxiliary layer the draft reads (EAGLE3 style)."""
        return self.hidden_size * self.hc_mult * max(1, len(self.draft_aux_layers))

    @classmethod
    def from_hf(cls, hf: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        # Gemma names its activation `hidden_activation`.
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        _refuse_gemma_options(hf)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        architecture = (getattr(hf, "architectures", None) or ["LlamaForCausalLM"])[0]
        sliding_layers = tuple(
            i
            for i, kind in enumerate(getattr(hf, "layer_types", None) or ())
            if kind == "sliding_attention"
        )
        return cls(
            architecture=architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            rope=_rope_from_hf(hf),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            hidden_act=act,
            sliding_window=getattr(hf, "sliding_window", None) if sliding_layers else None,
            sliding_layers=sliding_layers,
            query_pre_attn_scalar=getattr(hf, "query_pre_attn_scalar", None),
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
            moe=_moe_from_hf(hf, architecture),
            hc_mult=int(getattr(hf, "hc_mult", 1) or 1),
            eos_token_ids=eos_token_ids,
            **FAMILY_LAYER_OPTIONS.get(architecture, {}),
        )


def _moe_from_hf(hf: Any, architecture: str) -> MoeConfig | None:
    """Mixtral's experts in every layer, renormalised over the chosen k; Qwen3-MoE's in the
    layers that `mlp_only_layers` and `decoder_sparse_step` leave sparse, renormalised when
    `norm_topk_prob`. A shared expert (Qwen2-MoE's kind) is refused by name."""
    shared = getattr(hf, "shared_expert_intermediate_size", None) or getattr(
        hf, "n_shared_experts", None
    )
    if shared:
        raise UnsupportedModelError(
            f"{architecture}: shared experts are not supported (the engine runs routed experts "
            "only, as Mixtral and Qwen3-MoE have them)"
        )
    layers = range(hf.num_hidden_layers)
    if architecture == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.intermediate_size,
            renormalize=True,
            sparse_layers=tuple(layers),
        )
    if architecture != "Qwen3MoeForCausalLM":
        return None
    step = hf.decoder_sparse_step
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(hf.mlp_only_layers or ())
    sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    if hf.num_experts < 1 or not sparse:
        return None
    return MoeConfig(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        renormalize=bool(hf.norm_topk_prob),
        sparse_layers=sparse,
    )


def _refuse_gemma_options(hf: Any) -> None:
    """What a Gemma config may turn on that the engine does not run."""
    cap = getattr(hf, "attn_logit_softcapping", None)
    if cap is not None:
        raise UnsupportedModelError(
            f"attn_logit_softcapping={cap} is not supported (attention scores are not capped)"
        )
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "use_bidirectional_attention is not supported (attention is causal)"
        )


def _rope_from_hf(hf: Any) -> RopeConfig:
    # transformers >= 5 names everything in `rope_parameters` (Gemma 3: one set per layer
    # type); older configs split `rope_theta` and `rope_scaling`.
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if "full_attention" in params:
        local = params.get("sliding_attention")
        global_rope = _rope_from_parameters(hf, dict(params["full_attention"]))
        if local is None or "sliding_attention" not in (getattr(hf, "layer_types", None) or ()):
            return global_rope
        return dataclasses.replace(global_rope, local=_rope_from_parameters(hf, dict(local)))
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return _rope_from_parameters(hf, params)


def _rope_from_parameters(hf: Any, params: dict[str, Any]) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if getattr(hf, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    known = {f for f in RopeConfig.__dataclass_fields__} - {"theta", "rope_type", "local"}
    extras = {k: v for k, v in params.items() if k in known and v is not None}
    return RopeConfig(theta=float(params["rope_theta"]), rope_type=rope_type, **extras)
