"""The multi-layer EAGLE draft: K depths, each an MTP module (two norms, a projection, one
decoder layer), sharing the target's embedding, final norm and LM head. Saved and loaded in the
folder format of docs/draft-format.md."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from engine.attention import AttentionBackend
from engine.errors import ModelLoadError
from engine.executor.forward_batch import ForwardBatch
from engine.kernels import triton_usable
from engine.model_config import ModelConfig
from engine.models.linear import Linear
from engine.models.llama import DecoderLayer, RMSNorm, observed
from spec.config import DraftConfig
from spec.draft_vocab import check_draft_vocab

WEIGHTS_FILE = "model.safetensors"
VOCAB_TENSOR = "draft_vocab"
# Draft steps an engine may run: each has its own KV pool, and a verify span grows with them.
MAX_DRAFT_STEPS = 16


class DraftDepth(nn.Module):
    """g = layer(fc(concat(enorm(embed(token)), hnorm(h)))): depth d at position i reads the
    embedding of token x_{i+d+1} and h, the target's hidden state at i (depth 0) or depth d-1's
    output there, and its output g predicts x_{i+d+2} through the target's LM head."""

    def __init__(self, config: ModelConfig, in_width: int) -> None:
        """`config`: the target's, with the draft's own MLP width."""
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(in_width, config.rms_norm_eps)
        self.fc = Linear(config.hidden_size + in_width, config.hidden_size, bias=False)
        # Layer index 0: the depth's KV pool has exactly one layer.
        self.layer = DecoderLayer(config, 0)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return self.layer(self.fc(self.fc_input(embeds, hidden)), batch, rotary, backend)

    def fc_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """concat(enorm(embeds), hnorm(hidden)) for embeds [T, hidden_size], hidden [T, in]."""
        hidden = hidden.to(embeds.dtype)
        if not triton_usable(embeds) or observed(self.enorm, self.hnorm):
            return torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1)
        # Each norm writes its half of the input: no concatenation kernel.
        from engine.kernels.elementwise import rms_norm

        width = embeds.shape[-1]
        joined = embeds.new_empty((embeds.shape[0], width + hidden.shape[-1]))
        rms_norm(embeds, self.enorm.weight, self.enorm.eps, out=joined[:, :width])
        rms_norm(hidden, self.hnorm.weight, self.hnorm.eps, out=joined[:, width:])
        return joined


class MultiLayerEagleDraft(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        num_draft_steps: int,
        vocab: torch.Tensor | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        """`config`: the target's; `intermediate_size`: the depths' MLP width (None: the
        target's)."""
        super().__init__()
        self.config = config
        # The target's config with the depths' own MLP width: what each depth's layer is. A
        # depth's MLP is dense whatever the target's layers are (no experts for a MoE target).
        self.layer_config = dataclasses.replace(
            config, intermediate_size=intermediate_size or config.intermediate_size, moe=None
        )
        self.depths = nn.ModuleList(
            DraftDepth(self.layer_config, config.spec_hidden_size if d == 0 else config.hidden_size)
            for d in range(num_draft_steps)
        )
        # Target token ids the draft may propose (spec.draft_vocab), ascending; None: all. Kept
        # out of the state dict: it is chosen after training, from the data, not learned.
        self.vocab = vocab

    @property
    def num_draft_steps(self) -> int:
        return len(self.depths)

    @property
    def num_stored_depths(self) -> int:
        """Depths with weights of their own: the steps after them run the last one again."""
        return len({id(depth) for depth in self.depths})

    def reuse_last_depth(self, num_draft_steps: int) -> None:
        """Run the last depth again at every step up to `num_draft_steps`, as a one-layer
        EAGLE draft runs its layer step after step. Only the weights are shared: each step
        still has its own runner, token pool and KV pool in the engine."""
        while len(self.depths) < num_draft_steps:
            self.depths.append(self.depths[-1])

    @property
    def intermediate_size(self) -> int:
        return self.layer_config.intermediate_size


def save_draft(
    path: str | os.PathLike,
    draft: MultiLayerEagleDraft,
    target_name: str = "unknown",
    default_draft_steps: int | None = None,
) -> None:
    """Write `draft` as a draft folder: config.json and model.safetensors with HF layer names
    (the depths with weights of their own: a reused last depth is written once).
    `default_draft_steps`: the steps an engine runs it for by default (None: its depths)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = draft.vocab
    if vocab is not None:
        problem = check_draft_vocab(vocab.cpu(), draft.config.vocab_size)
        if problem:
            raise ValueError(f"the draft vocabulary {problem}")
    stored = draft.num_stored_depths
    config = DraftConfig.for_target(
        draft.config,
        stored,
        target_name,
        None if vocab is None else vocab.numel(),
        draft.intermediate_size,
        default_draft_steps,
    )
    (folder / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    tensors: dict[str, torch.Tensor] = {}
    if vocab is not None:
        tensors[VOCAB_TENSOR] = vocab
    for d, depth in enumerate(draft.depths[:stored]):
        prefix = f"depths.{d}."
        tensors[prefix + "enorm.weight"] = depth.enorm.weight
        tensors[prefix + "hnorm.weight"] = depth.hnorm.weight
        tensors[prefix + "fc.weight"] = depth.fc.weight
        for name, tensor in _unfused_layer(depth.layer, draft.layer_config).items():
            tensors[prefix + "layer." + name] = tensor
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        str(folder / WEIGHTS_FILE),
    )


def load_draft(
    path: str | os.PathLike,
    target: ModelConfig,
    num_draft_steps: int | None,
    device: str | torch.device,
    dtype: torch.dtype,
) -> MultiLayerEagleDraft:
    """The draft's first `num_draft_steps` depths (by default the folder's default_draft_steps,
    else all its depths; more steps than the folder has depths run its last depth again),
    refused with DraftMismatchError when it was made for a target of other shapes."""
    folder = Path(path)
    config = DraftConfig.load(folder)
    config.check_target(target, folder)
    asked = config.default_steps if num_draft_steps is None else num_draft_steps
    if not 1 <= asked <= MAX_DRAFT_STEPS:
        raise ModelLoadError(
            f"num_draft_steps={asked}: must be 1 to {MAX_DRAFT_STEPS} (draft {folder} has "
            f"{config.num_draft_steps} depths; steps beyond them run its last depth again)"
        )
    steps = min(asked, config.num_draft_steps)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, SafetensorError) as err:
        raise ModelLoadError(
            f"could not read draft weights {folder / WEIGHTS_FILE}: {err}"
        ) from err
    with torch.device("meta"):
        draft = MultiLayerEagleDraft(target, steps, intermediate_size=config.intermediate_size)
    draft = draft.to_empty(device=device)
    expected = _expected_names(draft)
    if config.draft_vocab_size is not None:
        draft.vocab = _draft_vocab(tensors.get(VOCAB_TENSOR), config, target, folder)
        expected.add(VOCAB_TENSOR)
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ModelLoadError(f"draft {folder} lacks {len(missing)} weights, e.g. {missing[:4]}")
    # Depths beyond `steps` are skipped on purpose; anything else unknown is a broken file.
    skipped = tuple(f"depths.{d}." for d in range(steps, config.num_draft_steps))
    unexpected = [k for k in tensors if k not in expected and not k.startswith(skipped)]
    if unexpected:
        raise ModelLoadError(f"unexpected weight {unexpected[0]!r} in draft {folder}")
    params = dict(draft.named_parameters())
    for d in range(steps):
        prefix = f"depths.{d}."
        layer = {
            k.removeprefix(prefix + "layer."): v
            for k, v in tensors.items()
            if k.startswith(prefix + "layer.")
        }
        fused = {prefix + "layer." + k: v for k, v in _fused_layer(layer).items()}
        for name in ("enorm.weight", "hnorm.weight", "fc.weight"):
            fused[prefix + name] = tensors[prefix + name]
        for name, tensor in fused.items():
            param = params[name]
            if param.shape != tensor.shape:
                raise ModelLoadError(
                    f"draft weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
    draft.reuse_last_depth(asked)
    return draft.to(dtype).eval()


def _draft_vocab(
    vocab: torch.Tensor | None, config: DraftConfig, target: ModelConfig, folder: Path
) -> torch.Tensor:
    if vocab is None:
        raise ModelLoadError(
            f"draft {folder} declares draft_vocab_size {config.draft_vocab_size} "
            f"but has no {VOCAB_TENSOR!r} tensor"
        )
    problem = check_draft_vocab(vocab, target.vocab_size)
    if problem is None and vocab.numel() != config.draft_vocab_size:
        problem = f"has {vocab.numel()} ids, config.json says {config.draft_vocab_size}"
    if problem:
        raise ModelLoadError(f"draft {folder}: {VOCAB_TENSOR!r} {problem}")
    return vocab


_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _unfused_layer(layer: DecoderLayer, config: ModelConfig) -> dict[str, torch.Tensor]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}
    out = {}
    for name, tensor in layer.state_dict().items():
        module, kind = name.rsplit(".", 1)
        parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
        if leaf in _PACKED:
            for part, piece in zip(_PACKED[leaf], tensor.split(sizes[leaf])):
                out[f"{parent}.{part}.{kind}"] = piece
        else:
            out[name] = tensor
    return out


def _fused_layer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    for fused, parts in _PACKED.items():
        parent = "self_attn" if fused == "qkv_proj" else "mlp"
        for kind in ("weight", "bias"):
            names = [f"{parent}.{p}.{kind}" for p in parts]
            if all(n in out for n in names):
                out[f"{parent}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def _expected_names(draft: MultiLayerEagleDraft) -> set[str]:
    names: set[str] = set()
    for d, depth in enumerate(draft.depths):
        for name in ("enorm.weight", "hnorm.weight", "fc.weight"):
            names.add(f"depths.{d}.{name}")
        for name in _unfused_layer(depth.layer, draft.layer_config):
            names.add(f"depths.{d}.layer.{name}")
    return names
