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
