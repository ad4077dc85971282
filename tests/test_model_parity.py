"""Logits of tiny random Llama checkpoints against Hugging Face transformers, float32 on CPU."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams

CONFIGS = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa2-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4-3layers": dict(
        hidden_size=96, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3
    ),
    "mqa-headdim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "rope-linear": dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "rope-llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 500000.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "rope-yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 128,
        }
    ),
}

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 60)), [5] * 23]


def _full_logits(
    llm: LLM, prompts: list[list[int]], split: int | None = None
) -> list[torch.Tensor]:
    """Prefill every prompt in one batch and return logits at every prompt position. With
    `split`, the first `split` tokens are cached by a first forward and the rest extend them."""
    core = llm.engine
    runner = core.runner
    requests = [
        core.make_request(str(i), p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)
    ]
    chunks = []
    for end in ([split] if split else []) + [None]:
        for req in requests:
            target = end if end is not None else req.num_tokens
            core.kv_cache.grow(req, target - req.kv_len)
        batch = runner.build_batch(
            [_Truncated(r, end) for r in requests] if end is not None else requests
        )
        with torch.inference_mode():
            hidden = runner.model(batch, runner.rotary, runner.attention)
            chunks.append((batch.extend_lens, runner.model.compute_logits(hidden)))
        for req in requests:
            req.kv_len = end if end is not None else req.num_tokens
    per_request: list[list[torch.Tensor]] = [[] for _ in prompts]
    for lens, logits in chunks:
        for i, piece in enumerate(logits.split(lens)):
            per_request[i].append(piece)
    for req in requests:
        core.kv_cache.release(req)
    return [torch.cat(pieces) for pieces in per_request]


class _Truncated:
    """A view of a request as if its tokens ended at `end`, for building a partial prefill."""

    def __init__(self, req, end: int) -> None:
        self._req, self._end = req, end

    def __getattr__(self, name):
        return getattr(self._req, name)

    @property
    def num_tokens(self) -> int:
        return self._end

    @property
    def all_token_ids(self) -> list[int]:
        return self._req.all_token_ids[: self._end]


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_transformers(tmp_path, name):
    hf = make_tiny_llama(tmp_path, **CONFIGS[name])
    llm = LLM(str(tmp_path), device="cpu", kv_cache_tokens=1024)
    ours = _full_logits(llm, PROMPTS)
    for prompt, logits in zip(PROMPTS, ours):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=2e-4, rtol=1e-4)
    assert llm.engine.kv_cache.is_empty()


@pytest.mark.parametrize("name", ["gqa2-tied", "rope-llama3"])
def test_extend_on_cached_prefix_matches_transformers(tmp_path, name):
    hf = make_tiny_llama(tmp_path, **CONFIGS[name])
    llm = LLM(str(tmp_path), device="cpu", kv_cache_tokens=1024)
    prompts = [p for p in PROMPTS if len(p) > 5]
    ours = _full_logits(llm, prompts, split=4)
    for prompt, logits in zip(prompts, ours):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mha-untied", "gqa4-3layers", "rope-yarn"])
def test_batched_greedy_decode_matches_transformers(tmp_path, name):
    hf = make_tiny_llama(tmp_path, **CONFIGS[name])
    llm = LLM(str(tmp_path), device="cpu", kv_cache_tokens=1024)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out.token_ids == ref[0, len(prompt) :].tolist()
