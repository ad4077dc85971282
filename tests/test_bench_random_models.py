"""bench/random_models.py: each family's random model is built with transformers' own classes,
loads into the engine on a CPU and generates, and weight_bytes counts what a decode step reads
(every parameter but the input embedding for dense models; for a mixture of experts, only one
token's experts). The full-size shapes keep their published dimensions."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from bench.random_models import SHAPES, random_model, weight_bytes
from engine import LLM, SamplingParams

TINY = ["tiny", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3-moe"]
ARCHITECTURES = {
    "tiny": "LlamaForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-gemma3": "Gemma3ForCausalLM",
    "tiny-qwen3-moe": "Qwen3MoeForCausalLM",
}


@pytest.mark.parametrize("name", TINY)
def test_tiny_shape_loads_into_the_engine_and_generates(name: str, tmp_path: Path) -> None:
    random_model(name, tmp_path / name, "cpu")
    config = AutoConfig.from_pretrained(tmp_path / name)
    assert config.architectures == [ARCHITECTURES[name]]
    llm = LLM(str(tmp_path / name), device="cpu", dtype="float32", kv_cache_tokens=256)
    # Longer than tiny-gemma3's window of 8, so that its sliding layers cut the context.
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out = llm.generate([prompt], params)
    assert len(out[0].token_ids) == 5
    assert all(0 <= t < config.vocab_size for t in out[0].token_ids)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-gemma3"])
def test_dense_weight_bytes_are_every_parameter_but_the_input_embedding(
    name: str, tmp_path: Path
) -> None:
    model = random_model(name, tmp_path / name, "cpu")
    config = AutoConfig.from_pretrained(tmp_path / name)
    params = sum(p.numel() for p in model.parameters())  # a tied LM head counts once
    if not config.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    assert weight_bytes(config) == 2 * params


def test_moe_weight_bytes_count_the_router_and_one_tokens_experts(tmp_path: Path) -> None:
    model = random_model("tiny-qwen3-moe", tmp_path / "moe", "cpu")
    config = AutoConfig.from_pretrained(tmp_path / "moe")
    params = sum(p.numel() for p in model.parameters())
    params -= model.get_input_embeddings().weight.numel()
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert len(experts) == config.num_hidden_layers
    per_expert = sum(p.numel() for p in experts[0].parameters()) // config.num_experts
    idle = config.num_experts - config.num_experts_per_tok
    assert weight_bytes(config) == 2 * (params - len(experts) * idle * per_expert)


def test_tiny_gemma3_norms_are_the_identity_as_one_plus_zero(tmp_path: Path) -> None:
    model = random_model("tiny-gemma3", tmp_path / "g", "cpu")
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(float(p.detach().abs().max()) == 0.0 for p in norms)
    assert model.config.layer_types.count("full_attention") == 1


def test_full_shapes_keep_the_published_dimensions() -> None:
    _, qwen = SHAPES["qwen3-8b"]
    assert (qwen["hidden_size"], qwen["intermediate_size"], qwen["num_hidden_layers"]) == (
        4096, 12288, 36,
    )  # fmt: skip
    _, gemma = SHAPES["gemma3-270m"]
    assert (gemma["vocab_size"], gemma["head_dim"], gemma["sliding_window"]) == (262144, 256, 512)
    _, moe = SHAPES["qwen3-moe-12l"]
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (
        128, 8, 768,
    )  # fmt: skip
    assert moe["num_hidden_layers"] == 12


def test_gpu_step_skips_a_transformers_column_after_it_fails(monkeypatch, tmp_path: Path) -> None:
    """A transformers column that fails (here: compiling, refused) is run once, then skipped
    with the reason at the larger batch sizes; the other columns are still measured."""
    import argparse

    from bench import gpu_step

    tried = []
    real = gpu_step.hf_generate

    def refusing_compile(model, x, **kw):
        if "compile_config" not in kw:
            return real(model, x, **kw)
        tried.append(x.shape[0])

        def refuse(n: int) -> int:
            raise RuntimeError("this family cannot be compiled")

        return refuse

    monkeypatch.setattr(gpu_step, "hf_generate", refusing_compile)
    args = argparse.Namespace(
        model=None, device="cpu", dtype="bfloat16", skip_hf=False, hf_models=None,
        prompt_len=8, steps=2, repeats=1, attention_backend=None,
    )  # fmt: skip
    rows, _ = gpu_step.bench_model("tiny-qwen3-moe", args, [1, 2], 1e9, tmp_path)
    assert tried == [1]
    assert rows[0]["hf_compiled"].startswith("error: RuntimeError: this family cannot")
    assert rows[1]["hf_compiled"] == "skipped (transformers failed at b=1)"
    for r in rows:
        assert isinstance(r["hf_eager"], float) and isinstance(r["engine_eager"], float)
