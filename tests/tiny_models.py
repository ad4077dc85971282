"""Tiny random Llama checkpoints for tests: a HF model saved with a small byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_DEFAULTS = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# A minimal chat template for the byte tokenizer, which has none of its own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per byte, plus three special tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Save a random tiny Llama (float32) with a tokenizer under `path`; returns the HF model."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_DEFAULTS, **overrides})
    model = LlamaForCausalLM(config).eval()
    # Random init keeps logits near-uniform; spread them so greedy choices are well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model


def widen_to_hyper_llama(path: Path, hc_mult: int = 2, mix_noise: float = 0.3, seed: int = 0):
    """Turn the Llama folder at `path` into a hyper-connection Llama (engine.models.hyper_llama)
    in place: the same weights, `hc_mult` in config.json, and read/write weights of each copy
    1 + `mix_noise` * N(0, 1) (the LM head's mix: that over hc_mult). With mix_noise = 0 and
    hc_mult = 1 it computes exactly what the Llama does."""
    import json

    from safetensors.torch import load_file, save_file

    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    raw.update(architectures=["HyperLlamaForCausalLM"], model_type="hyper_llama", hc_mult=hc_mult)
    config_file.write_text(json.dumps(raw, indent=2))
    generator = torch.Generator().manual_seed(seed)

    def mix(*shape: int) -> torch.Tensor:
        return 1 + mix_noise * torch.randn(*shape, generator=generator)

    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    for layer in range(raw["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.hc_read"] = mix(2, hc_mult)
        tensors[f"model.layers.{layer}.hc_write"] = mix(2, hc_mult)
    tensors["model.hc_head"] = mix(hc_mult) / hc_mult
    save_file(tensors, str(weights), metadata={"format": "pt"})


def make_tiny_hyper_llama(
    path: Path, seed: int = 0, hc_mult: int = 2, mix_noise: float = 0.3, **overrides
) -> None:
    """A random tiny hyper-connection Llama: a tiny Llama's weights, widened (see above)."""
    make_tiny_llama(path, seed=seed, **overrides)
    widen_to_hyper_llama(path, hc_mult, mix_noise, seed)


def save_chat_template(path: Path) -> None:
    """Give the tokenizer saved under `path` the CHAT_TEMPLATE above."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
