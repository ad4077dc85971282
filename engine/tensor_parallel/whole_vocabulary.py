"""Rank 0's copy of the model's token embedding, final norm and LM head, whole: what a
speculative draft embeds its tokens with and proposes through.

A draft runs on rank 0 alone. Its depths are one decoder layer each, so splitting them over
the ranks would add two collectives to every draft step for a layer's worth of compute, and
would make each depth wait on every rank (the followers would have to step through the draft's
loop too). The draft does read the target's embedding and LM head, which the ranks split by
vocabulary rows: called on rank 0 alone, those modules would wait in a collective that no
follower joins. So rank 0 loads a second, whole copy of the three into a model of no layers,
which gives the draft the same `embed`, `lm_head_logits` and `cap_logits` as one rank's model.
The copy costs rank 0 one embedding and one head (computed from the shapes: 57 MB in bfloat16
for SmolLM2's tied 49,152 x 576, 2.1 GB for an untied 128,256 x 4,096), and the draft's steps
no collective."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.loading.weights import iter_safetensors
from engine.model_config import ModelConfig
from engine.models import model_class
from engine.models.llama import LlamaForCausalLM

# The checkpoint's tensors a model of no layers holds.
VOCABULARY_WEIGHTS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def vocabulary_config(model_config: ModelConfig) -> ModelConfig:
    """`model_config` without its decoder layers (nor what names a layer)."""
    return dataclasses.replace(
        model_config, num_layers=0, sliding_layers=(), draft_aux_layers=(), moe=None
    )


def load_vocabulary_model(
    model_path: Path, model_config: ModelConfig, engine_config: EngineConfig
) -> LlamaForCausalLM:
    """The whole embedding, final norm and LM head of the checkpoint at `model_path`, on
    `engine_config`'s device and dtype, in a model of no layers."""
    config = vocabulary_config(model_config)
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to_empty(device=engine_config.device).to(engine_config.dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(_vocabulary_weights(iter_safetensors(model_path)))
    return model.eval()


def _vocabulary_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    return ((name, tensor) for name, tensor in weights if name in VOCABULARY_WEIGHTS)
