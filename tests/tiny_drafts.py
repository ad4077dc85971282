"""Draft folders for tiny targets: a random draft (accepts almost nothing) and a "good" draft
for a target built so that one decoder layer nearly reproduces it (accepts a lot)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file
from tiny_models import byte_tokenizer, make_tiny_llama
from transformers import LlamaForCausalLM

from engine.loading.weights import load_hf_config
from engine.model_config import ModelConfig
from spec.draft_model import MultiLayerEagleDraft, _fused_layer, save_draft


def target_config(target_path: Path) -> ModelConfig:
    return ModelConfig.from_hf(load_hf_config(target_path))


def make_random_draft(path: Path, target_path: Path, num_draft_steps: int, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    draft = MultiLayerEagleDraft(target_config(target_path), num_draft_steps)
    save_draft(path, draft, target_name=target_path.name)
    return path


def make_predictable_llama(
    path: Path, seed: int = 0, logit_scale: float = 1.0, **overrides
) -> LlamaForCausalLM:
    """A one-layer tiny Llama whose attention barely matters (o_proj scaled down) and whose
    embedding rows have unit RMS: its next token depends mostly on the current token, so a
    draft layer that copies its layer predicts it well, though not perfectly. `logit_scale`
    sharpens (> 1) its next-token distributions."""
    make_tiny_llama(path, seed=seed, num_hidden_layers=1, **overrides)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.3)
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model


def make_good_draft(
    path: Path, target_path: Path, num_draft_steps: int, noise: float = 0.0, seed: int = 0
) -> Path:
    """Every depth: fc passes the (unit-RMS, so unchanged by enorm) token embedding through,
    perturbed by `noise` times random weights over embedding and hidden state so that some
    drafts miss; the layer is the target's only layer."""
    torch.manual_seed(seed)
    hf = LlamaForCausalLM.from_pretrained(target_path).eval()
    config = target_config(target_path)
    draft = MultiLayerEagleDraft(config, num_draft_steps)
    src = hf.model.layers[0]
    hidden = config.hidden_size
    with torch.no_grad():
        for depth in draft.depths:
            # [pass-through | a little of the hidden state], so the hidden input matters too.
            depth.fc.weight.copy_(noise * torch.randn(hidden, 2 * hidden))
            depth.fc.weight[:, :hidden] += torch.eye(hidden)
            layer = depth.layer
            attn, mlp = src.self_attn, src.mlp
            layer.self_attn.qkv_proj.weight.copy_(
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            )
            layer.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            )
            layer.mlp.down_proj.weight.copy_(mlp.down_proj.weight)
            layer.input_layernorm.weight.copy_(src.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
    save_draft(path, draft, target_name=target_path.name)
    return path


def make_eagle3_draft(
    path: Path, target_path: Path, num_draft_steps: int, aux_layers: tuple[int, ...], seed: int = 0
) -> Path:
    """A random EAGLE3-style draft: depth 0 reads the outputs of the target's `aux_layers`
    side by side (spec_hidden_size = len(aux_layers) * the target's stream width)."""
    torch.manual_seed(seed)
    config = dataclasses.replace(target_config(target_path), draft_aux_layers=aux_layers)
    save_draft(path, MultiLayerEagleDraft(config, num_draft_steps), target_name=target_path.name)
    return path


def make_predictable_deep_llama(path: Path, num_layers: int, seed: int = 0) -> None:
    """make_predictable_llama's target with `num_layers` layers, all after the first nearly the
    identity (their o_proj and down_proj scaled by 0.02): layer 0 still decides the next token,
    so a draft copying it predicts well, while every layer's output differs a little."""
    make_tiny_llama(path, seed=seed, num_hidden_layers=num_layers)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.3)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def make_copying_draft(
    path: Path,
    target_path: Path,
    num_draft_steps: int,
    noise: float = 0.0,
    aux_layers: tuple[int, ...] = (),
    seed: int = 0,
) -> Path:
    """make_good_draft for any target folder (a Llama, a hyper-connection Llama, with or
    without auxiliary layers): every depth's layer is the target's layer 0, read from its
    safetensors; fc passes the token embedding through, plus `noise` times random weights over
    embedding and hidden state, whatever the hidden state's width."""
    torch.manual_seed(seed)
    config = dataclasses.replace(target_config(target_path), draft_aux_layers=aux_layers)
    draft = MultiLayerEagleDraft(config, num_draft_steps)
    prefix = "model.layers.0."
    tensors = load_file(str(target_path / "model.safetensors"))
    layer = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    layer = {k: v for k, v in _fused_layer(layer).items() if not k.startswith("hc_")}
    hidden = config.hidden_size
    with torch.no_grad():
        for depth in draft.depths:
            depth.fc.weight.copy_(noise * torch.randn(hidden, depth.fc.in_features))
            depth.fc.weight[:, :hidden] += torch.eye(hidden)
            depth.layer.load_state_dict(layer)
    save_draft(path, draft, target_name=target_path.name)
    return path
