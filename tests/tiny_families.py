"""Tiny random checkpoints of the families beside Llama (Qwen2, Qwen3 dense), built with
transformers' own config and model classes and saved, float32, with tiny_models' byte-level
tokenizer. The models come back in eager attention: the reference the engine is compared to."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import TINY_DEFAULTS, byte_tokenizer
from transformers import (
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# Qwen3Config's own head_dim (128) would dwarf the tiny hidden size.
FAMILY_DEFAULTS = {"qwen2": {}, "qwen3": {"head_dim": 16}}


def make_tiny_family(path: Path, family: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """Save a random tiny model of `family` ("qwen2", "qwen3") under `path`; returns it.

    transformers starts biases at zero and norm weights at one, which would hide a bias or a
    norm the engine forgot: they are drawn at random here. The logits are spread out so that
    greedy choices are well separated (see tiny_models.make_tiny_llama): by the LM head, or
    with tied embeddings by the final norm, and then the layers' outputs are scaled up too,
    since a residual stream that is mostly its own token's embedding makes the tied head
    repeat that token forever."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    fields = {**TINY_DEFAULTS, **FAMILY_DEFAULTS[family], **overrides}
    config = config_class(**fields, attn_implementation="eager")
    model = model_class(config).eval()
    tied = config.tie_word_embeddings
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif tied and name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(8.0)
        (model.model.norm if tied else model.lm_head).weight.mul_(8.0)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model


# HF module names -> llama.cpp's, in a layer (blk.N.<name>.weight / .bias).
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_tiny_gguf(model: PreTrainedModel, file: Path) -> Path:
    """`model` (from make_tiny_family) as a float32 GGUF file, named as llama.cpp names a Qwen2
    or Qwen3 checkpoint, with the byte-level tokenizer as a merge-free GPT-2 BPE vocabulary.
    transformers reads no head_dim from a Qwen3 GGUF file: it takes Qwen3Config's own (128),
    so a Qwen3 model written here needs that head_dim."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(file), config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
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
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a GGUF file without output.weight ties the head to the embedding
        gguf_name = _GGUF_NAMES.get(name)
        if gguf_name is None:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"
        writer.add_tensor(gguf_name, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file
