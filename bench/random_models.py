"""Models of well-known shapes with random weights, for GPU benchmarks of speed alone (which
does not depend on weight values): saved as Hugging Face folders with a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
FIELDS += ("num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
SHAPES = {
    "smollm2": (49152, 576, 1536, 30, 9, 3, 64, True, 100000.0),
    "llama8b": (128256, 4096, 14336, 32, 32, 8, 128, False, 500000.0),
    "tiny": (1024, 64, 128, 2, 4, 2, 16, False, 10000.0),  # for a smoke run on a CPU
}  # the FIELDS, then rope_theta


def random_model(name: str, folder: Path, device: str) -> Any:
    """Build `name` with random bf16 weights on `device`, save it with a tokenizer, return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = dict(zip(FIELDS, SHAPES[name]), rope_theta=SHAPES[name][-1])
    config = LlamaConfig(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never an fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in model.parameters():  # tied weights come once
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    # A byte-level BPE without merges: one token per byte after <unk>, <s>, </s> (eos: id 2).
    tokens = ["<unk>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    return model


def weight_bytes(c: Any) -> int:
    """bf16 bytes a decode step reads: decoder layers, final norm, LM head."""
    attention = 2 * c.hidden_size * c.head_dim * (c.num_attention_heads + c.num_key_value_heads)
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return 2 * (c.num_hidden_layers * layer + c.hidden_size * (1 + c.vocab_size))
