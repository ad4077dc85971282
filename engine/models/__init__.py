"""Model definitions, chosen by the HF architecture name of a checkpoint: the Llama decoder
(engine.models.llama) runs Llama, Mistral, Qwen2, Qwen3 (dense) and Gemma 3 (text) checkpoints,
each family's layer options read into ModelConfig (engine.model_config.FAMILY_LAYER_OPTIONS),
and the mixtures of experts Mixtral and Qwen3-MoE (ModelConfig.moe, engine.models.moe)."""

from __future__ import annotations

from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig
from engine.models.hyper_llama import HyperLlamaForCausalLM
from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "HyperLlamaForCausalLM": HyperLlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class implementing `config.architecture`, refused when it cannot run the config."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported "
            f"(supported: {', '.join(MODEL_CLASSES)})"
        )
    if config.hc_mult != 1 and not issubclass(cls, HyperLlamaForCausalLM):
        raise UnsupportedModelError(
            f"hc_mult={config.hc_mult} needs a model with hyper-connections "
            f"(HyperLlamaForCausalLM), not {config.architecture}"
        )
    return cls
