"""GGUF files that the conversion through transformers (engine.loading.default_model.convert_gguf)
would turn into another model than they hold, refused by their metadata before any conversion.

transformers reads the experts of a mixture-of-experts GGUF file for Qwen3-MoE (`qwen3moe`)
only, and gives them Qwen3MoeConfig's expert width whatever the file says (it reads no
`expert_feed_forward_length`). Mixtral's files are `llama` files with experts: transformers would
convert one into a dense Llama whose MLP weights are left at random."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModelError

# The GGUF architectures whose experts transformers converts.
GGUF_EXPERT_ARCHITECTURES = ("qwen3moe",)


def check_gguf_experts(gguf_file: Path) -> None:
    """Refuse a mixture-of-experts GGUF file that transformers cannot convert faithfully."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_file))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not read GGUF file {gguf_file}: {err}") from err

    def field(key: str) -> Any:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    architecture = field("general.architecture")
    experts = field(f"{architecture}.expert_count") or 0
    if not experts:
        return
    if architecture not in GGUF_EXPERT_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_file}: a GGUF file of architecture {architecture!r} with {experts} experts "
            "(Mixtral's files are such) cannot be converted: transformers reads the experts of "
            f"{', '.join(GGUF_EXPERT_ARCHITECTURES)} files only and would drop these; load the "
            "model's HF folder (safetensors) instead"
        )
    from transformers import Qwen3MoeConfig

    converted = Qwen3MoeConfig().moe_intermediate_size
    width = field(f"{architecture}.expert_feed_forward_length")
    if width is not None and width != converted:
        raise UnsupportedModelError(
            f"{gguf_file}: its experts are {width} wide, but transformers converts "
            f"{architecture} GGUF files with experts {converted} wide (it reads no "
            "expert_feed_forward_length); load the model's HF folder (safetensors) instead"
        )
