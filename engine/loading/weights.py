"""Finding a model on disk and reading its config, weights and tokenizer, with typed errors."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from engine.env import cache_dir
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading.default_model import (
    PACKAGED_MODELS,
    convert_gguf,
    default_model_path,
    ensure_converted,
    packaged_model_path,
)
from engine.models import MODEL_CLASSES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "hyper_llama",
)
# Why some architectures near the supported ones are refused, said with the refusal.
REFUSAL_REASONS = {
    "Qwen2MoeForCausalLM": "shared experts are not supported, routed experts are",
}
# The architectures whose sliding-window layers the engine runs (engine.model_config.ModelConfig's
# sliding_layers); any other with such layers is refused.
SLIDING_WINDOW_ARCHITECTURES = ("Gemma3ForCausalLM",)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "convert_gguf",
    "iter_safetensors",
    "model_fingerprint",
    "load_hf_config",
    "load_tokenizer",
    "resolve_model",
]


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The HF folder to load: the default model, a model a package ships (by its name,
    `PACKAGED_MODELS`), a converted .gguf file, or a checked folder."""
    if model is None:
        return default_model_path()
    if str(model) in PACKAGED_MODELS and not Path(model).exists():
        return packaged_model_path(str(model))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path not found: {path} (expected a folder with config.json and "
            f"*.safetensors, a .gguf file, or one of {', '.join(PACKAGED_MODELS)})"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model file {path} is not a .gguf file (expected a .gguf file, or a folder "
                "with config.json and *.safetensors)"
            )
        return ensure_converted(path, cache_dir() / "models" / _gguf_cache_name(path))
    _check_folder(path)
    return path


def _gguf_cache_name(gguf_file: Path) -> str:
    stat = gguf_file.stat()
    key = f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _check_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    if _safetensors_files(folder):
        return
    if any(folder.glob("pytorch_model*.bin")) or any(folder.glob("*.pt")):
        raise ModelLoadError(
            f"model folder {folder} holds only PyTorch pickle weights (*.bin/*.pt); only "
            "safetensors is supported: convert them to *.safetensors first"
        )
    raise ModelLoadError(f"model folder {folder} has no *.safetensors weight files")


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# What a model computes with, besides its weights; a converted folder also holds a note of its
# source file, which names the file's path and time and so is left out.
_FINGERPRINTED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
_FINGERPRINT_EDGE = 1 << 20


def model_fingerprint(folder: Path) -> str:
    """A digest of a model folder's content: its config, tokenizer and chat template, and each
    weight file's size, first and last MiB. Two conversions of one GGUF file land in folders
    of different names but get the same digest; another model gets another one. Cheap enough
    for multi-gigabyte weights, since it reads two MiB of each file."""
    digest = hashlib.sha256()
    for name in _FINGERPRINTED_FILES:
        file = folder / name
        if file.exists():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    for file in _safetensors_files(folder):
        size = file.stat().st_size
        digest.update(f"{file.name}|{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(_FINGERPRINT_EDGE))
            handle.seek(max(0, size - _FINGERPRINT_EDGE))
            digest.update(handle.read(_FINGERPRINT_EDGE))
    return digest.hexdigest()[:16]


def load_hf_config(path: Path) -> PretrainedConfig:
    """The folder's HF config, refused with UnsupportedModelError unless we implement it."""
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not read {config_file}: {err}") from err
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} does not hold a JSON object")
    # Checked on the raw JSON first, so an architecture transformers does not know still gets
    # this message rather than an AutoConfig error.
    _check_supported(raw, config_file)
    from engine.models.hf_configs import register_hf_configs

    register_hf_configs()
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"could not load the config in {path}: {err}") from err
    _check_attention_layers(config, config_file)
    return config


def _check_attention_layers(config: PretrainedConfig, config_file: Path) -> None:
    """Refuse attention the engine does not run. A config with `layer_types` (Qwen2, Qwen3,
    Gemma 3) names each layer's kind, and keeps a `sliding_window` that its full-attention
    layers ignore; one without (Mistral) slides every layer whenever `sliding_window` is set.
    Sliding-window layers run for SLIDING_WINDOW_ARCHITECTURES only."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    windows_run = architecture in SLIDING_WINDOW_ARCHITECTURES
    if layer_types is None:
        if window is not None:
            raise UnsupportedModelError(
                f"{config_file}: sliding_window={window} on every layer is not supported "
                "(sliding windows run for "
                f"{', '.join(SLIDING_WINDOW_ARCHITECTURES)} only; it must be null)"
            )
        return
    runnable = ("full_attention", "sliding_attention") if windows_run else ("full_attention",)
    refused = [i for i, kind in enumerate(layer_types) if kind not in runnable]
    if refused:
        kinds = sorted({layer_types[i] for i in refused})
        raise UnsupportedModelError(
            f"{config_file}: layers {refused} use {', '.join(kinds)} (sliding_window={window}); "
            f"{architecture or 'this architecture'} runs only {' and '.join(runnable)} here "
            f"(sliding windows run for {', '.join(SLIDING_WINDOW_ARCHITECTURES)})"
        )


def _check_supported(raw: dict[str, Any], config_file: Path) -> None:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    architectures = raw.get("architectures") or []
    unknown = [name for name in architectures if name not in SUPPORTED_ARCHITECTURES]
    if unknown:
        reasons = "".join(
            f"; {name}: {REFUSAL_REASONS[name]}" for name in unknown if name in REFUSAL_REASONS
        )
        raise UnsupportedModelError(
            f"{config_file}: architecture {', '.join(unknown)} is not supported{reasons} "
            f"(supported: {supported})"
        )
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{config_file}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; architectures: {supported})"
        )
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise UnsupportedModelError(
            f"{config_file}: quantized checkpoints ({method or 'unknown method'}) are not "
            "supported; use unquantized safetensors weights"
        )


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, CPU tensor) of the folder's *.safetensors files, streamed one at a time."""
    files = _safetensors_files(Path(path))
    if not files:
        raise ModelLoadError(f"model folder {path} has no *.safetensors weight files")
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (OSError, SafetensorError) as err:
            raise ModelLoadError(f"could not read weights file {file}: {err}") from err
        with handle:
            names = handle.keys()  # safe_open handles are not iterable
            for name in names:
                try:
                    tensor = handle.get_tensor(name)
                except (OSError, SafetensorError) as err:
                    raise ModelLoadError(
                        f"could not read tensor {name!r} from {file}: {err}"
                    ) from err
                yield name, tensor


def load_tokenizer(path: Path) -> Any:
    """The folder's tokenizer (AutoTokenizer)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    # Tokenizer loading fails through many exception types depending on the backend and file.
    except Exception as err:
        raise ModelLoadError(f"could not load the tokenizer in {path}: {err}") from err
