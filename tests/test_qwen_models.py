"""Qwen2 and Qwen3 (dense) against transformers' own Qwen2ForCausalLM and Qwen3ForCausalLM,
float32 on CPU: logits at every prompt position, greedy output token for token (batched prompts
of different lengths, whole or in chunks, and through a prefill node and a decode node), what
each family adds to the Llama decoder (Qwen2's q/k/v biases, Qwen3's per-head q/k norms, tied
or untied embeddings, rope_theta), and the refusals of what the engine cannot run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from family_checks import edit_config, every_token_logits, hf_greedy
from tiny_drafts import make_random_draft
from tiny_families import make_tiny_family, write_tiny_gguf

from engine import LLM, SamplingParams, UnsupportedModelError
from engine.loading.weights import SUPPORTED_ARCHITECTURES

# name -> (family, seed, overrides): GQA and MQA, 2 and 3 layers, tied and untied embeddings,
# a head_dim that is not hidden_size / heads, Qwen2's biases, Qwen3's norms (with and without
# attention_bias), a rope_theta and a yarn scaling of their own. The seeds give greedy outputs
# that move between tokens rather than repeat one.
MODELS = {
    "qwen2": ("qwen2", 1, dict(num_hidden_layers=3, rope_parameters={"rope_theta": 1e6})),
    "qwen2-tied-mqa": ("qwen2", 1, dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-tied": ("qwen3", 1, dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-bias": (
        "qwen3",
        0,
        dict(
            num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, attention_bias=True
        ),
    ),
    "qwen3-yarn": (
        "qwen3",
        2,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 128,
            }
        ),
    ),
}
GENERATED = ["qwen2", "qwen2-tied-mqa", "qwen3-tied", "qwen3-bias"]
PROMPTS = [
    [1, 17, 99, 4, 250, 31, 8],
    [1, 200],
    list(range(3, 60)),
    [5] * 23,
    [7, 300, 12, 12, 90, 45, 200, 3, 3, 3, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_tokens=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("qwen")
    built = {}
    for name, (family, seed, overrides) in MODELS.items():
        built[name] = (root / name, make_tiny_family(root / name, family, seed, **overrides))
    return built


_references: dict[str, list[list[int]]] = {}


def _reference(models, name: str) -> list[list[int]]:
    if name not in _references:
        _references[name] = hf_greedy(models[name][1], PROMPTS, MAX_TOKENS)
    return _references[name]


def test_each_family_turns_on_its_layer_options(models) -> None:
    expected = {
        "qwen2": dict(qkv_bias=True, attention_bias=False, qk_norm=False),
        "qwen2-tied-mqa": dict(qkv_bias=True, attention_bias=False, qk_norm=False),
        "qwen3-tied": dict(qkv_bias=False, attention_bias=False, qk_norm=True),
        "qwen3-bias": dict(qkv_bias=False, attention_bias=True, qk_norm=True),
    }
    for name, options in expected.items():
        llm = LLM(str(models[name][0]), **ENGINE)
        config = llm.model_config
        assert {key: getattr(config, key) for key in options} == options, name
        # The draft reads the last layer's output: as wide as for a Llama.
        assert config.spec_hidden_size == config.hidden_size
        attention = llm.engine.runner.model.model.layers[0].self_attn
        assert (attention.q_norm is not None) == options["qk_norm"]
    qwen2 = LLM(str(models["qwen2"][0]), **ENGINE).model_config
    assert qwen2.rope.theta == 1e6 and qwen2.num_layers == 3
    assert "Qwen2ForCausalLM" in SUPPORTED_ARCHITECTURES
    assert "Qwen3ForCausalLM" in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers_at_every_position(models, name: str) -> None:
    path, hf = models[name]
    llm = LLM(str(path), **ENGINE)
    for prompt, logits in zip(PROMPTS, every_token_logits(llm, PROMPTS)):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert llm.engine.kv_cache.is_empty()


@pytest.mark.parametrize("chunk", [0, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", GENERATED)
def test_batched_greedy_output_equals_transformers(models, name: str, chunk: int) -> None:
    """All prompts (2 to 57 tokens) at once; with chunk 16 the longer ones prefill in chunks."""
    llm = LLM(str(models[name][0]), chunked_prefill_size=chunk, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == _reference(models, name)
    assert llm.engine.kv_cache.is_empty()


@pytest.mark.parametrize("name", ["qwen2", "qwen3-tied"])
def test_speculative_decoding_over_each_family_is_lossless(models, name: str, tmp_path) -> None:
    """A draft's depths are the target's decoder layer: Qwen2's have q/k/v biases and
    Qwen3's q/k norms, saved and loaded with the draft."""
    path = models[name][0]
    draft = make_random_draft(tmp_path / "draft", path, num_draft_steps=3, seed=5)
    layer = draft / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(layer), framework="pt") as handle:
        names = set(handle.keys())
    family_weight = {
        "qwen2": "depths.0.layer.self_attn.k_proj.bias",
        "qwen3-tied": "depths.0.layer.self_attn.k_norm.weight",
    }[name]
    assert family_weight in names
    llm = LLM(
        str(path),
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        num_draft_steps=3,
        **ENGINE,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == _reference(models, name)


def test_tensor_dump_holds_the_query_and_key_norms(models, tmp_path) -> None:
    path = models["qwen3-tied"][0]
    llm = LLM(str(path), debug_tensor_dump_dir=str(tmp_path), **ENGINE)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
    first = tmp_path / "offline" / "target" / "rank0" / "forward_000000.pt"
    outputs = torch.load(first, weights_only=True)["outputs"]
    config = llm.model_config
    tokens = len(PROMPTS[0])
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}.self_attn"
        assert outputs[f"{prefix}.q_norm"].shape == (tokens, config.num_heads, config.head_dim)
        assert outputs[f"{prefix}.k_norm"].shape == (tokens, config.num_kv_heads, config.head_dim)
        assert outputs[f"{prefix}.qkv_proj"].shape[0] == tokens
    # Each head of the query norm's output has the RMS of its weight's pattern, not of q.
    normed = outputs["model.layers.0.self_attn.q_norm"]
    weight = llm.engine.runner.model.model.layers[0].self_attn.q_norm.weight.detach()
    rms = (normed / weight).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)


def test_an_unsupported_family_is_refused_with_the_supported_list(models, tmp_path) -> None:
    folder = edit_config(
        models["qwen3-tied"][0],
        tmp_path / "phi3",
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
    )
    with pytest.raises(UnsupportedModelError, match="Phi3ForCausalLM") as raised:
        LLM(str(folder), **ENGINE)
    message = str(raised.value)
    assert all(name in message for name in SUPPORTED_ARCHITECTURES), message


@pytest.mark.parametrize("family", ["qwen2", "qwen3-tied"])
def test_an_unsupported_rope_scaling_is_refused(models, tmp_path, family: str) -> None:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    folder = edit_config(models[family][0], tmp_path / "dynamic", rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match="'dynamic'.*default, linear, llama3, yarn"):
        LLM(str(folder), **ENGINE)


def test_sliding_window_layers_are_refused_but_an_unused_window_is_not(models, tmp_path) -> None:
    source = models["qwen2"][0]  # 3 layers
    sliding = edit_config(
        source,
        tmp_path / "sliding",
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        layer_types=None,
    )
    with pytest.raises(UnsupportedModelError, match=r"layers \[1, 2\] use sliding_attention"):
        LLM(str(sliding), **ENGINE)
    # Qwen2.5's configs carry a window that use_sliding_window=false turns off.
    unused = edit_config(
        source, tmp_path / "unused", use_sliding_window=False, sliding_window=32768
    )
    outputs = LLM(str(unused), **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == _reference(models, "qwen2")


def test_prefill_and_decode_nodes_give_the_offline_output(models) -> None:
    """A 1P1D cluster on CPU: the prompt's KV crosses from the prefill node over gloo, checked
    against a transfer spec that fingerprints the Qwen3 config."""
    pytest.importorskip("ray")
    from cluster_helpers import launch

    name = "qwen3-tied"
    expected = _reference(models, name)
    offline = LLM(str(models[name][0]), **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in offline] == expected
    cluster = launch(str(models[name][0]), prefill=1, decode=1, kv_cache_tokens=2048)
    try:
        outputs = asyncio.run(_generate_all(cluster.router, PROMPTS))
        assert cluster.kv_pools_empty()
    finally:
        cluster.shutdown()
    assert outputs == expected


async def _generate_all(router, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in router.generate(f"qwen-{i}", prompt, GREEDY):
            tokens += delta.token_ids
        return tokens

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await router.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2", "qwen3-tied"])
def test_the_gpu_kernels_give_transformers_output(models, name: str) -> None:
    """The Triton path: the q/k norms before the fused rotary and KV write, the biases in the
    packed QKV projection, the fused norms, with CUDA graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(str(models[name][0]), device="cuda", dtype="float32", kv_cache_tokens=2048)
    assert llm.config.attention_backend == "triton"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == _reference(models, name)


@pytest.mark.gpu
def test_a_biased_linear_takes_the_matrix_vector_product_and_adds_its_bias() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.nn.functional as F

    from engine.models.linear import Linear, gemv_applies

    layer = Linear(4096, 4608, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert gemv_applies(x, layer.weight)
        torch.testing.assert_close(
            layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2
        )


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_gguf_file_converts_into_the_same_model(tmp_path, monkeypatch, family: str) -> None:
    """The GGUF path (transformers dequantizes the file into a HF folder once) works for both
    families: the biases and the q/k norms come through, and the tokens are the folder's."""
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path / "cache"))
    # transformers gives a Qwen3 GGUF file its config's default head_dim (128), as real
    # Qwen3 checkpoints have.
    overrides = {"qwen2": {}, "qwen3": {"head_dim": 128, "tie_word_embeddings": True}}[family]
    hf = make_tiny_family(tmp_path / "folder", family, seed=1, **overrides)
    gguf_file = write_tiny_gguf(hf, tmp_path / f"{family}.gguf")
    from_gguf = LLM(str(gguf_file), **ENGINE)
    from_folder = LLM(str(tmp_path / "folder"), **ENGINE)
    assert from_gguf.model_config.architecture == from_folder.model_config.architecture
    assert from_gguf.model_config.qkv_bias == (family == "qwen2")
    assert from_gguf.model_config.qk_norm == (family == "qwen3")
    ours = [o.token_ids for o in from_gguf.generate(PROMPTS, GREEDY)]
    assert ours == [o.token_ids for o in from_folder.generate(PROMPTS, GREEDY)]
