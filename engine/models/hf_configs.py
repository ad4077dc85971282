"""Hugging Face config classes for the architectures of engine.models that transformers does not
ship, registered with AutoConfig so that their checkpoint folders load like any other. Imported
only where transformers already is (engine.loading.weights.load_hf_config)."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, LlamaConfig


class HyperLlamaConfig(LlamaConfig):
    """A Llama config with `hc_mult`, the number of copies in the residual stream
    (engine.models.hyper_llama)."""

    model_type = "hyper_llama"

    def __init__(self, hc_mult: int = 2, **kwargs: Any) -> None:
        self.hc_mult = hc_mult
        super().__init__(**kwargs)


def register_hf_configs() -> None:
    AutoConfig.register(HyperLlamaConfig.model_type, HyperLlamaConfig, exist_ok=True)
