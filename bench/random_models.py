"""Models of well-known shapes with random weights, for GPU benchmarks of speed alone (which
does not depend on weight values): saved as Hugging Face folders with a byte-level tokenizer.
Each family is built with transformers' own config and model classes: Llama, Qwen3 (dense,
per-head query and key norms), Gemma 3 text (sliding-window and global layers, norms applied
as 1 + w) and Qwen3-MoE. The `tiny*` shapes are small enough for a smoke run on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# family: (transformers config class, model class), by their names in transformers.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# The families whose norms apply a weight w as 1 + w: zero is their identity.
UNIT_OFFSET_NORMS = ("gemma3",)
# The byte-level tokenizer's ids, which every shape's config names as its own.
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _dense(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, tied: bool) -> dict[str, Any]:  # fmt: skip
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, tie_word_embeddings=tied,
    )  # fmt: skip


def _llama(*dims: Any, rope_theta: float) -> tuple[str, dict[str, Any]]:
    fields = dict(rope_theta=rope_theta, rms_norm_eps=1e-5, max_position_embeddings=8192)
    return "llama", {**_dense(*dims), **fields}


def _qwen3(*dims: Any) -> tuple[str, dict[str, Any]]:
    # Qwen3-8B's config.json: rope_theta 1e6, rms_norm_eps 1e-6, untied.
    fields = dict(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)
    return "qwen3", {**_dense(*dims), **fields}


def _gemma3(*dims: Any, window: int, query_scalar: float) -> tuple[str, dict[str, Any]]:
    # Gemma 3 270M's config.json: Gemma3TextConfig's own layer types (a global layer after every
    # five sliding ones), local and global rope bases 1e4 and 1e6, no final logit soft-capping.
    fields = dict(
        sliding_window=window, query_pre_attn_scalar=query_scalar, final_logit_softcapping=None,
        rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    )  # fmt: skip
    return "gemma3", {**_dense(*dims), **fields}


def _qwen3_moe(*dims: Any, experts: int, per_token: int, width: int) -> tuple[str, dict]:
    # Qwen3-30B-A3B's config.json: every layer sparse, top-k weights renormalised.
    fields = dict(
        num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=width,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
    )  # fmt: skip
    return "qwen3_moe", {**_dense(*dims), **fields}


# The dense fields, in order: vocab, hidden, intermediate, layers, heads, KV heads, head_dim, tied.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2": _llama(49152, 576, 1536, 30, 9, 3, 64, True, rope_theta=100000.0),
    # SmolLM2-135M with 8 query heads and 2 KV heads: its own 9 and 3 do not split over 2 ranks.
    "smollm2-8h": _llama(49152, 576, 1536, 30, 8, 2, 64, True, rope_theta=100000.0),
    "llama8b": _llama(128256, 4096, 14336, 32, 32, 8, 128, False, rope_theta=500000.0),
    "qwen3-8b": _qwen3(151936, 4096, 12288, 36, 32, 8, 128, False),
    "gemma3-270m": _gemma3(262144, 640, 2048, 18, 4, 1, 256, True, window=512, query_scalar=256),
    # Qwen3-30B-A3B's layers, 12 of its 48 (about 7.7B parameters instead of 30.5B), so that
    # random initialisation and saving stay quick; a step's time per layer is what is compared.
    "qwen3-moe-12l": _qwen3_moe(
        151936, 2048, 6144, 12, 32, 4, 128, False, experts=128, per_token=8, width=768
    ),
    "tiny": _llama(1024, 64, 128, 2, 4, 2, 16, False, rope_theta=10000.0),
    "tiny-qwen3": _qwen3(1024, 64, 128, 2, 4, 2, 16, False),
    # Six layers: five sliding, one global, with a window shorter than a smoke run's prompt.
    "tiny-gemma3": _gemma3(1024, 64, 128, 6, 4, 1, 16, True, window=8, query_scalar=16),
    "tiny-qwen3-moe": _qwen3_moe(
        1024, 64, 128, 2, 4, 2, 16, False, experts=8, per_token=2, width=32
    ),
}


def random_model(name: str, folder: Path, device: str) -> Any:
    """Build `name` with random bf16 weights on `device`, save it with a tokenizer, return it."""
    import transformers

    family, fields = SHAPES[name]
    config_class, model_class = (getattr(transformers, n) for n in FAMILIES[family])
    config = config_class(**fields, **TOKEN_IDS)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never an fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(previous)
    norm = 0.0 if family in UNIT_OFFSET_NORMS else 1.0
    with torch.no_grad():
        for p in model.parameters():  # tied weights come once; every 1-d weight is a norm's
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(norm)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return model


def byte_level_tokenizer() -> Any:
    """A byte-level BPE without merges: one token per byte after <unk>, <s>, </s> (eos: id 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


# The model types with an RMSNorm over each head's queries and keys.
QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")


def weight_bytes(c: Any) -> int:
    """bf16 bytes a decode step at batch 1 reads: decoder layers, final norm, LM head (the
    input embedding, of which a step reads one row a token, is left out). A mixture of experts'
    layer reads its router and the experts of one token alone: at larger batches the tokens
    pick different experts and a step reads more of them, up to all."""
    attention = 2 * c.hidden_size * c.head_dim * (c.num_attention_heads + c.num_key_value_heads)
    if c.model_type in QK_NORM:
        attention += 2 * c.head_dim
    norms = (4 if c.model_type == "gemma3_text" else 2) * c.hidden_size  # Gemma: sandwich norms
    dense_mlp = 3 * c.hidden_size * c.intermediate_size
    sparse_layers, experts, per_token, width = moe_shape(c)
    sparse_mlp = experts * c.hidden_size + per_token * 3 * c.hidden_size * width
    layers = c.num_hidden_layers * (attention + norms)
    layers += (c.num_hidden_layers - sparse_layers) * dense_mlp + sparse_layers * sparse_mlp
    return 2 * (layers + c.hidden_size * (1 + c.vocab_size))


def moe_shape(c: Any) -> tuple[int, int, int, int]:
    """(sparse layers, experts, experts per token, expert width) of a config; zeros if dense.
    Qwen3-MoE's sparse layers as engine.model_config reads them: those `mlp_only_layers` leaves out,
    every `decoder_sparse_step`-th."""
    if c.model_type == "qwen3_moe":
        dense = set(c.mlp_only_layers or ())
        sparse = [i for i in range(c.num_hidden_layers)
                  if i not in dense and (i + 1) % c.decoder_sparse_step == 0]  # fmt: skip
        return len(sparse), c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    if c.model_type == "mixtral":
        shape = (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size)
        return (c.num_hidden_layers, *shape)
    return 0, 0, 0, 0
