"""The embedded default model: greedy token ids identical to transformers' `generate`, whether
requests run one by one or batched together."""

from __future__ import annotations

import asyncio

import pytest
import torch
from family_checks import hf_greedy

from engine import LLM, SamplingParams
from engine.loading.default_model import default_model_path

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a short recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What are the three states of matter?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "How many legs does a spider have?",
    "Suggest a name for a pet turtle.",
    "Qu'est-ce que la photosynthèse ?",
    "Describe the color red to someone who cannot see.",
    "What is the boiling point of water in Fahrenheit?",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=32)


@pytest.fixture(scope="module")
def prompts(default_llm) -> list[list[int]]:
    return [default_llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def hf_reference(prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    return hf_greedy(hf, prompts, MAX_TOKENS, stop_at_eos=True)


def _trim_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_one_by_one_matches_transformers(default_llm, prompts, hf_reference):
    eos = set(default_llm.model_config.eos_token_ids)
    for prompt, ref in zip(prompts, hf_reference):
        [out] = default_llm.generate([prompt], GREEDY)
        assert out.token_ids == _trim_after_eos(ref, eos)


def test_batched_matches_transformers(default_llm, prompts, hf_reference):
    eos = set(default_llm.model_config.eos_token_ids)
    outputs = default_llm.generate(prompts, GREEDY)
    for out, ref in zip(outputs, hf_reference):
        assert out.token_ids == _trim_after_eos(ref, eos)
    assert default_llm.engine.kv_cache.is_empty()


def test_chat_returns_text_of_its_tokens(default_llm):
    [out] = default_llm.chat([[{"role": "user", "content": CHATS[0]}]], GREEDY)
    assert out.text == default_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "Paris" in out.text
    assert out.usage.prompt_tokens == len(
        default_llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    )


def test_disaggregated_matches_offline_and_transformers(default_llm, prompts, hf_reference):
    """Prefill and decode in different processes (Ray actors, KV over gloo): same tokens."""
    pytest.importorskip("ray")
    from cluster_helpers import launch

    eos = set(default_llm.model_config.eos_token_ids)
    offline = default_llm.generate(prompts, GREEDY)
    cluster = launch(None, prefill=2, decode=2, kv_cache_tokens=8192)
    try:
        outputs = asyncio.run(_generate_all(cluster.router, prompts))
        assert cluster.kv_pools_empty()
    finally:
        cluster.shutdown()
    for tokens, off, ref in zip(outputs, offline, hf_reference):
        assert tokens == off.token_ids == _trim_after_eos(ref, eos)


async def _generate_all(router, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in router.generate(f"parity-{i}", prompt, GREEDY):
            tokens += delta.token_ids
        return tokens

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await router.close()
