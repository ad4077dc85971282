"""Checks that a request can ever be served, shared by the engine and the cluster's router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import RequestRejectedError
from engine.executor.prompt_embeds import PromptEmbeds
from engine.sampling.sampling_params import SamplingParams

# A signed 64-bit integer: the range OpenAI documents for `seed`, and what msgpack carries to
# the nodes and a torch int64 tensor holds, so that no value admitted here fails on the way.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def validate_request(
    prompt: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    kv_cache_tokens: int,
    hidden_size: int,
    prompt_embeds: PromptEmbeds | None = None,
    max_tokens_cap: int | None = None,
) -> None:
    if not prompt:
        raise RequestRejectedError("the prompt is empty")
    # By the set of the tokens' types, then min and max: a loop in C, not in Python, over
    # prompts of thousands of tokens.
    if not all(issubclass(kind, int) for kind in set(map(type, prompt))) or not (
        0 <= min(prompt) and max(prompt) < vocab_size
    ):
        raise RequestRejectedError(f"prompt token ids must be integers in [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise RequestRejectedError(
            f"top_k must be at most the vocabulary size ({vocab_size}), got {params.top_k}"
        )
    if any(token >= vocab_size for token, _ in params.logit_bias_items):
        raise RequestRejectedError(
            f"logit_bias keys must be token ids in [0, {vocab_size}), the model's vocabulary",
            param="logit_bias",
        )
    if params.seed is not None and not INT64_MIN <= params.seed <= INT64_MAX:
        raise RequestRejectedError(
            f"seed must be a signed 64-bit integer ({INT64_MIN} to {INT64_MAX}), got {params.seed}"
        )
    if max_tokens_cap is not None and params.max_tokens > max_tokens_cap:
        raise RequestRejectedError(
            f"max_tokens ({params.max_tokens}) exceeds this server's cap of {max_tokens_cap} "
            f"tokens per request (--max-tokens-cap)",
            param="max_tokens",
        )
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        raise RequestRejectedError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the context length of {max_model_len} tokens"
        )
    if total > kv_cache_tokens:
        raise RequestRejectedError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the KV cache of {kv_cache_tokens} tokens"
        )
    if prompt_embeds is not None:
        prompt_embeds.check(len(prompt), hidden_size)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """The tokenizer's chat template applied to `messages`, ending where the answer starts."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
