"""`engine.LLM`: the offline, in-process generator (the aggregated baseline)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig, default_device, resolve_dtype
from engine.engine_core import EngineCore
from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.weights import iter_safetensors, load_hf_config, load_tokenizer, resolve_model

Prompt = str | list[int]
Message = dict[str, str]

DEFAULT_CPU_KV_BYTES = 2 * 1024**3
DEFAULT_GPU_KV_FRACTION = 0.8


class LLM:
    """Generate from a Hugging Face folder, a GGUF file, or (model=None) the embedded default."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_tokens: int | None = None,
        max_prefill_tokens: int = 8192,
        attention_backend: str = "torch",
        seed: int = 0,
    ) -> None:
        self.model_path = resolve_model(model)
        hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model_config = ModelConfig.from_hf(
            hf_config, _eos_token_ids(self.model_path, hf_config)
        )
        device = device or default_device()
        torch_dtype = resolve_dtype(dtype, device)
        max_model_len = max_model_len or self.model_config.max_position_embeddings
        if kv_cache_tokens is None:
            kv_cache_tokens = _default_kv_tokens(self.model_config, torch_dtype, device)
        self.config = EngineConfig(
            device=device,
            dtype=torch_dtype,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            # More slots than every sequence at full length could use are never needed.
            kv_cache_tokens=min(kv_cache_tokens, max_num_seqs * max_model_len),
            max_prefill_tokens=max_prefill_tokens,
            attention_backend=attention_backend,
            seed=seed,
        )
        runner = ModelRunner(self.model_config, self.config, iter_safetensors(self.model_path))
        self.engine = EngineCore(runner, self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; outputs come back in the same order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, sampling_params)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Each conversation is a list of {"role", "content"} messages; the model's chat
        template turns it into a prompt that ends where the assistant's answer starts."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_lists = [self.apply_chat_template(c) for c in conversations]
        return self._run(token_lists, sampling_params)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(
        self,
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(
                    f"{len(params_list)} SamplingParams for {len(token_lists)} prompts"
                )
        # Validate everything before running anything, so one bad prompt costs no work.
        requests = [
            self.engine.make_request(str(next(self._ids)), tokens, params)
            for tokens, params in zip(token_lists, params_list)
        ]
        for req in requests:
            self.engine.add_request(req)
        while self.engine.has_work():
            self.engine.step()
        return [self.engine.output(req) for req in requests]


def _eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    from transformers import GenerationConfig

    eos: Any = None
    if (path / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def _default_kv_tokens(config: ModelConfig, dtype: torch.dtype, device: str) -> int:
    per_token = KVPool.bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, dtype
    )
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        # Weights are not loaded yet: leave room for them, and a share for activations.
        budget = int(free * DEFAULT_GPU_KV_FRACTION) - _weight_bytes(config, dtype)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    return max(1, budget // per_token)


def _weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    c = config
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return (c.num_layers * (attention + mlp) + embeddings) * dtype.itemsize
