"""Gemma 3 (text) against transformers' own Gemma3ForCausalLM, float32 on CPU: a tiny random model
with every part of Gemma's layer (interleaved sliding-window and global layers with a window
shorter than the prompts, each kind with its own rotary embedding and the global one scaled,
GQA, query and key norms, the four norms of a layer with weights applied as 1 + w, GELU-tanh,
scaled and tied embeddings, query_pre_attn_scalar, final logit soft-capping). Logits at every
position, greedy output token for token (batched prompts of different lengths, whole or in chunks
shorter than the window), speculative decoding with chains and trees, a draft vocabulary's soft
cap, tensor dumps, a GGUF file, a prefill node and a decode node (speculating, in chunks), and the
refusals of what the engine does not run. The window in each attention backend:
tests/test_sliding_window_attention.py; the draft trainer's forwards over a Gemma target:
tests/test_train_draft.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from family_checks import edit_config, every_token_logits, hf_greedy
from tiny_drafts import make_random_draft
from tiny_families import make_tiny_family, write_tiny_gguf

from engine import LLM, ModelLoadError, SamplingParams, UnsupportedModelError
from engine.loading.weights import SUPPORTED_ARCHITECTURES
from engine.request import spec_totals

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
GEMMA = dict(
    num_hidden_layers=4,
    layer_types=LAYER_TYPES,
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,
    final_logit_softcapping=30.0,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
# Every prompt but the second is longer than the window; with the generated tokens, all are.
PROMPTS = [
    [1, 17, 99, 4, 250, 31, 8, 77, 12],
    [1, 200],
    list(range(3, 60)),
    [5] * 23,
    [7, 300, 12, 12, 90, 45, 200, 3, 3, 3, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_tokens=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gemma3") / "gemma3"
    return path, make_tiny_family(path, "gemma3", seed=0, **GEMMA)


@pytest.fixture(scope="module")
def reference(gemma) -> list[list[int]]:
    return hf_greedy(gemma[1], PROMPTS, MAX_TOKENS)


def test_the_config_turns_on_gemmas_options(gemma) -> None:
    config = LLM(str(gemma[0]), **ENGINE).model_config
    assert config.architecture == "Gemma3ForCausalLM" in SUPPORTED_ARCHITECTURES
    assert (config.sliding_window, config.sliding_layers) == (WINDOW, (0, 2, 3))
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert config.qk_norm and config.sandwich_norms and config.norm_unit_offset
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    assert config.embed_scale == 64**0.5 and config.query_scale == (16 / 24) ** 0.5
    assert config.final_logit_softcapping == 30.0
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1e6, "linear", 4.0)
    assert (config.rope.local.theta, config.rope.local.rope_type) == (1e4, "default")
    # The draft reads the last layer's output: as wide as for a Llama.
    assert config.spec_hidden_size == config.hidden_size


def test_logits_match_transformers_at_every_position(gemma) -> None:
    path, hf = gemma
    llm = LLM(str(path), **ENGINE)
    for prompt, logits in zip(PROMPTS, every_token_logits(llm, PROMPTS)):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert llm.engine.kv_cache.is_empty()


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole", "chunked"])
def test_batched_greedy_output_equals_transformers(gemma, reference, chunk: int) -> None:
    """All prompts (2 to 57 tokens) at once; with chunk 5 every prompt longer than it prefills
    in chunks shorter than the window, each chunk's sliding layers reading the cached prefix."""
    llm = LLM(str(gemma[0]), chunked_prefill_size=chunk, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert llm.engine.kv_cache.is_empty()


def test_the_window_changes_the_output(gemma, reference, tmp_path) -> None:
    """The tests above would pass for an engine that ignored the window only if it did not
    matter: without it (a window longer than every sequence), the output differs."""
    wide = edit_config(gemma[0], tmp_path / "wide", sliding_window=4096)
    outputs = LLM(str(wide), **ENGINE).generate(PROMPTS, GREEDY)
    differ = [o.token_ids != ref for o, ref in zip(outputs, reference)]
    assert differ[1:] == [True] * (len(PROMPTS) - 1), differ


@pytest.mark.parametrize(
    "tree", [{}, {"speculative_topk": 2, "num_draft_tokens": 6}], ids=["chain", "tree"]
)
def test_speculative_decoding_is_lossless(gemma, reference, tmp_path, tree: dict) -> None:
    """Verify spans (the newest token and a chain of drafts, or a draft tree) attend through the
    window of the sliding layers. The draft's depths are Gemma layers of the first layer's kind
    (sliding, with the local rotary embedding), their four norms saved with the draft."""
    path = gemma[0]
    draft = make_random_draft(tmp_path / "draft", path, num_draft_steps=3, seed=5)
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="pt") as handle:
        assert "depths.0.layer.post_feedforward_layernorm.weight" in set(handle.keys())
    llm = LLM(
        str(path),
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        num_draft_steps=3,
        **tree,
        **ENGINE,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert spec_totals(o.usage for o in outputs).verify_steps > 0
    assert llm.engine.kv_cache.is_empty()


def test_tensor_dump_holds_the_four_norms_of_each_layer(gemma, tmp_path) -> None:
    llm = LLM(str(gemma[0]), debug_tensor_dump_dir=str(tmp_path), **ENGINE)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
    first = tmp_path / "offline" / "target" / "rank0" / "forward_000000.pt"
    outputs = torch.load(first, weights_only=True)["outputs"]
    tokens, hidden = len(PROMPTS[0]), llm.model_config.hidden_size
    norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
    for layer in range(len(LAYER_TYPES)):
        for norm in norms:
            assert outputs[f"model.layers.{layer}.{norm}_layernorm"].shape == (tokens, hidden)
    # The attention's output, normalised before its residual add: the RMS of 1 + w per row.
    normed = outputs["model.layers.0.post_attention_layernorm"]
    weight = llm.engine.runner.model.model.layers[0].post_attention_layernorm.weight.detach()
    rms = (normed / (1 + weight)).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)


def test_a_gguf_file_converts_into_the_same_model(tmp_path, monkeypatch) -> None:
    """transformers converts a Gemma 3 GGUF file (its norms stored as 1 + w) into a
    Gemma3ForCausalLM folder; the file carries the window and the global rope base, and the
    rest takes Gemma3TextConfig's defaults (a global layer every sixth). The global layers'
    linear rope scaling, which the file carries too (as Gemma 3 4B's does) but transformers
    does not read, is added to the converted config."""
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path / "cache"))
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    hf = make_tiny_family(
        tmp_path / "folder",
        "gemma3",
        seed=3,
        num_hidden_layers=6,
        sliding_window=6,
        rope_parameters=rope,
    )
    from_gguf = LLM(str(write_tiny_gguf(hf, tmp_path / "gemma3.gguf")), **ENGINE)
    from_folder = LLM(str(tmp_path / "folder"), **ENGINE)
    config = from_gguf.model_config
    # GGUF stores the norms' epsilon in float32.
    assert config.rms_norm_eps == pytest.approx(from_folder.model_config.rms_norm_eps)
    assert dataclasses.replace(config, rms_norm_eps=1e-6) == from_folder.model_config
    assert config.sliding_layers == (0, 1, 2, 3, 4) and config.sliding_window == 6
    assert (config.rope.rope_type, config.rope.factor) == ("linear", 8.0)
    ours = [o.token_ids for o in from_gguf.generate(PROMPTS, GREEDY)]
    assert ours == hf_greedy(hf, PROMPTS, MAX_TOKENS)


def _metadata_only_gguf(file: Path, block_count: int, scaling: str | None = None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(file), "gemma3")
    writer.add_block_count(block_count)
    writer.add_embedding_length(5376)
    writer.add_head_count(32)
    if scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling))
        writer.add_rope_scaling_factor(8.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def test_a_27b_gguf_file_keeps_llama_cpps_attention_scale(tmp_path) -> None:
    """llama.cpp scales a 62-layer Gemma 3's scores by 1 / sqrt(hidden_size / heads) (the
    27B's query_pre_attn_scalar, 168); no field of the file says so."""
    from engine.loading.default_model import with_what_transformers_drops

    config = {"query_pre_attn_scalar": 256, "rope_parameters": {"full_attention": {}}}
    fixed = with_what_transformers_drops(_metadata_only_gguf(tmp_path / "27b.gguf", 62), config)
    assert fixed == {"query_pre_attn_scalar": 168, "rope_parameters": {"full_attention": {}}}
    other = with_what_transformers_drops(_metadata_only_gguf(tmp_path / "12b.gguf", 48), config)
    assert other == config
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' in a Gemma 3 GGUF file"):
        with_what_transformers_drops(_metadata_only_gguf(tmp_path / "y.gguf", 48, "yarn"), config)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        (
            {"layer_types": ["chunked_attention", *LAYER_TYPES[1:]]},
            r"layers \[0\] use chunked_attention",
        ),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
            "Gemma3ForConditionalGeneration is not supported",
        ),
    ],
    ids=["attention-softcap", "bidirectional", "chunked", "multimodal"],
)
def test_what_is_not_run_is_refused(gemma, tmp_path, fields: dict, message: str) -> None:
    folder = edit_config(gemma[0], tmp_path / "edited", **fields)
    with pytest.raises(UnsupportedModelError, match=message) as raised:
        LLM(str(folder), **ENGINE)
    if "architectures" in fields:
        assert all(name in str(raised.value) for name in SUPPORTED_ARCHITECTURES), raised.value


def test_a_draft_vocabulary_keeps_the_logit_soft_cap(gemma) -> None:
    """A draft restricted to part of the vocabulary proposes from the target's own logits
    there, soft-capped as the whole head's are."""
    from spec.draft_vocab import DraftHead

    target = LLM(str(gemma[0]), **ENGINE).engine.runner.model
    vocab = torch.arange(3, 300, 2)
    hidden = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = target.lm_head_logits(hidden)
        uncapped = target.lm_head(target.model.norm(hidden))
        restricted = DraftHead(target, vocab)._logits(hidden)
    assert not torch.allclose(whole, uncapped, rtol=0, atol=1e-3)  # the cap bends them
    torch.testing.assert_close(restricted, whole[:, vocab])


def test_prefill_and_decode_nodes_give_the_offline_output(gemma, reference, tmp_path) -> None:
    """A 1P1D cluster on CPU, speculating with a random Gemma draft, with chunks of 16: the
    prompts of 9 and 2 tokens prefill whole (the first longer than the window), the others in
    chunks whose sliding layers read the cached prefix. The target's KV (sliding and global
    layers alike) and each draft depth's cross from the prefill node over gloo, checked against
    a transfer spec that fingerprints the config; the decode node verifies through the window.
    The offline engine gives `reference` for both settings (the tests above)."""
    pytest.importorskip("ray")
    from cluster_helpers import launch, wait_for

    draft = make_random_draft(tmp_path / "draft", gemma[0], num_draft_steps=3, seed=5)
    cluster = launch(
        str(gemma[0]),
        prefill=1,
        decode=1,
        kv_cache_tokens=2048,
        chunked_prefill_size=16,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        num_draft_steps=3,
    )
    try:
        results = asyncio.run(_generate_all(cluster.router, PROMPTS))
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()
    assert [tokens for tokens, _ in results] == reference
    assert all(usage["spec_verify_steps"] > 0 for _, usage in results)


async def _generate_all(router, prompts: list[list[int]]) -> list[tuple[list[int], dict]]:
    async def one(i: int, prompt: list[int]) -> tuple[list[int], dict]:
        tokens: list[int] = []
        usage = None
        async for delta in router.generate(f"gemma-{i}", prompt, GREEDY):
            tokens += delta.token_ids
            usage = delta.usage or usage
        return tokens, usage

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await router.close()


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "tree"])
def test_the_gpu_kernels_give_transformers_output(gemma, reference, tmp_path, speculative) -> None:
    """The Triton path: the window in the paged-attention kernel (decode, prefill and verify
    graphs, chunks after a cached prefix, a draft tree's verify), Gemma's norms in torch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    extra = {}
    if speculative:
        draft = make_random_draft(tmp_path / "draft", gemma[0], num_draft_steps=3, seed=5)
        extra = dict(
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(draft),
            num_draft_steps=3,
            speculative_topk=2,
            num_draft_tokens=6,
        )
    for chunk in (0, 5):
        llm = LLM(
            str(gemma[0]),
            device="cuda",
            dtype="float32",
            kv_cache_tokens=2048,
            chunked_prefill_size=chunk,
            **extra,
        )
        assert llm.config.attention_backend == "triton"
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
