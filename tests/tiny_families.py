"""Tiny random checkpoints of the families beside Llama (Qwen2, Qwen3 dense, Gemma 3 text, and
the mixtures of experts Mixtral and Qwen3-MoE),
built with transformers' own config and model classes and saved, float32, with tiny_models'
byte-level tokenizer. The models come back in eager attention: the reference the engine is
compared to."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import TINY_DEFAULTS, byte_tokenizer
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}
# The families whose norms apply a weight w as 1 + w (transformers starts w at zero).
UNIT_OFFSET_NORMS = ("gemma3",)
# Qwen3Config's and Gemma3TextConfig's own head_dim (128, 256) would dwarf the tiny hidden size.
FAMILY_DEFAULTS = {
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma3": {"head_dim": 16, "tie_word_embeddings": True},
    # Eight experts of the dense width; Qwen3-MoE's own head_dim and expert width would dwarf
    # the model too.
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
    },
}
# The routers' own initialisation (zeros for Qwen3-MoE) would send every token to the same
# experts: drawn with this spread instead, each token picks its own.
ROUTER_STD = 0.5


def make_tiny_family(path: Path, family: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """Save a random tiny model of `family` ("qwen2", "qwen3", "gemma3") under `path`; returns
    it.

    transformers starts biases at zero and norms at the identity, which would hide a bias or a
    norm the engine forgot: they are drawn at random here (Gemma's applied weights 1 + w as
    the others' w). The logits are spread out so that greedy choices are well separated (see
    tiny_models.make_tiny_llama): by the LM head, or with tied embeddings by the final norm,
    and then the layers' outputs are scaled up too (in Gemma, whose norms after each sublayer
    undo that scale, by those norms' random weights alone), since a residual stream that is
    mostly its own token's embedding makes the tied head repeat that token forever."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    fields = {**TINY_DEFAULTS, **FAMILY_DEFAULTS[family], **overrides}
    config = config_class(**fields, attn_implementation="eager")
    model = model_class(config).eval()
    tied = config.tie_word_embeddings
    offset = 1.0 if family in UNIT_OFFSET_NORMS else 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, ROUTER_STD)
            elif "norm" in name:
                param.copy_(1.0 - offset + 0.3 * torch.randn_like(param))
            elif tied and name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(8.0)
        if tied:
            weight = model.model.norm.weight
            weight.copy_(8.0 * (weight + offset) - offset)
        else:
            model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model


def write_tiny_gguf(model: PreTrainedModel, file: Path) -> Path:
    """`model` (from make_tiny_family) as a float32 GGUF file, named as llama.cpp names a Qwen2,
    Qwen3, Gemma 3 or Qwen3-MoE checkpoint (gguf's own name map; a MoE layer's experts as one
    tensor per projection, ffn_{gate,up,down}_exps), with the byte-level tokenizer as a
    merge-free GPT-2 BPE vocabulary. transformers reads no head_dim from a Qwen3 GGUF file: it
    takes Qwen3Config's own (128), so a Qwen3 model written here needs that head_dim. A Gemma 3
    file names no layer types, local rope base or query_pre_attn_scalar: a model written here
    needs Gemma3TextConfig's defaults (a global layer every sixth, 10,000, 256). Nor does it
    read a Qwen3-MoE file's expert width: it takes Qwen3MoeConfig's (768), and renormalises the
    top-k weights (norm_topk_prob), as llama.cpp does."""
    import gguf

    config = model.config
    arch = {
        "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3,
        "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
        "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    }[config.model_type]
    gemma = arch == gguf.MODEL_ARCH.GEMMA3
    writer = gguf.GGUFWriter(str(file), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope["full_attention"] if gemma else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if gemma:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
        # As llama.cpp's converter writes the global layers' scaling (Gemma 3 4B and larger).
        if rope["full_attention"].get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    vocab = byte_tokenizer().get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    # The model's vocabulary is larger than the tokenizer's: the rest are unused rows.
    unused = [f"<unused{i}>" for i in range(config.vocab_size - len(tokens))]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    tokens += unused
    types += [gguf.TokenType.UNUSED] * len(unused)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a GGUF file without output.weight ties the head to the embedding
        tensor = tensor.detach().float()
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1.0  # llama.cpp stores Gemma's norm weights as applied, 1 + w
        if ".mlp.experts." in name:
            for gguf_name, part in _expert_tensors(name, tensor):
                writer.add_tensor(gguf_name, part.contiguous().numpy())
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def _expert_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A layer's stacked experts (transformers' gate_up_proj [E, 2I, H], down_proj [E, H, I]) as
    llama.cpp's ffn_gate_exps and ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I]."""
    layer = int(name.split(".")[2])
    if name.endswith("gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", gate),
            (f"blk.{layer}.ffn_up_exps.weight", up),
        ]
    return [(f"blk.{layer}.ffn_down_exps.weight", tensor)]
