"""Mixtral and Qwen3-MoE against transformers' own MixtralForCausalLM and Qwen3MoeForCausalLM,
float32 on CPU: tiny random models (several layers, GQA, 6 or 8 experts with top-2; Qwen3-MoE
with dense layers by `mlp_only_layers` or `decoder_sparse_step`, top-k weights renormalised or
not). Logits at every position, greedy output token for token (batched prompts of different
lengths, whole or in chunks), the grouped expert GEMMs against a per-token reference, lossless
speculative decoding with a draft trained by `pdcluster train-draft`, tensor dumps of the router,
GGUF files, and the refusals of what the engine does not run (a prefill and a decode node:
test_moe_cluster.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from family_checks import edit_config, every_token_logits, hf_greedy
from safetensors.torch import load_file, save_file
from tiny_families import make_tiny_family, write_tiny_gguf
from tiny_models import save_chat_template

from engine import LLM, SamplingParams, UnsupportedModelError
from engine.errors import ModelLoadError
from engine.loading.weights import SUPPORTED_ARCHITECTURES
from engine.model_config import MoeConfig
from engine.models.llama import MLP
from engine.models.moe import Experts, SparseMoeBlock, grouped_mm_runs, linear_per_group
from engine.request import spec_totals

# name -> (family, seed, overrides). The seeds give greedy outputs that move between tokens.
MODELS = {
    # 8 experts in each of 3 layers, top-2 renormalised.
    "mixtral": ("mixtral", 3, dict(num_hidden_layers=3)),
    # 6 experts, top-2 weights as the softmax gave them; layer 1 dense (mlp_only_layers).
    "qwen3-moe": ("qwen3_moe", 1, dict(num_hidden_layers=3, mlp_only_layers=[1])),
    # Every second layer sparse (decoder_sparse_step), weights renormalised, 8 query heads of
    # 2 KV heads.
    "qwen3-moe-step": (
        "qwen3_moe",
        7,
        dict(
            num_hidden_layers=4,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            num_attention_heads=8,
            num_key_value_heads=2,
        ),
    ),
}
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
    root = tmp_path_factory.mktemp("moe")
    built = {}
    for name, (family, seed, overrides) in MODELS.items():
        built[name] = (root / name, make_tiny_family(root / name, family, seed, **overrides))
    return built


_references: dict[str, list[list[int]]] = {}


def _reference(models, name: str) -> list[list[int]]:
    if name not in _references:
        _references[name] = hf_greedy(models[name][1], PROMPTS, MAX_TOKENS)
    return _references[name]


def test_the_config_reads_each_familys_experts(models) -> None:
    expected = {
        "mixtral": MoeConfig(8, 2, 128, renormalize=True, sparse_layers=(0, 1, 2)),
        "qwen3-moe": MoeConfig(6, 2, 48, renormalize=False, sparse_layers=(0, 2)),
        "qwen3-moe-step": MoeConfig(6, 2, 48, renormalize=True, sparse_layers=(1, 3)),
    }
    for name, moe in expected.items():
        llm = LLM(str(models[name][0]), **ENGINE)
        config = llm.model_config
        assert config.moe == moe, name
        assert config.qk_norm == name.startswith("qwen3"), name
        # The draft reads the last layer's output: as wide as for a dense model.
        assert config.spec_hidden_size == config.hidden_size
        layers = llm.engine.runner.model.model.layers
        for i, layer in enumerate(layers):
            kind = SparseMoeBlock if i in moe.sparse_layers else MLP
            assert type(layer.mlp) is kind, (name, i)
        experts = layers[moe.sparse_layers[0]].mlp.experts
        assert experts.gate_up_proj.shape == (moe.num_experts, 2 * moe.intermediate_size, 64)
        assert experts.down_proj.shape == (moe.num_experts, 64, moe.intermediate_size)
    assert {"MixtralForCausalLM", "Qwen3MoeForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


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
@pytest.mark.parametrize("name", sorted(MODELS))
def test_batched_greedy_output_equals_transformers(models, name: str, chunk: int) -> None:
    """All prompts (2 to 57 tokens) at once; with chunk 16 the longer ones prefill in chunks."""
    llm = LLM(str(models[name][0]), chunked_prefill_size=chunk, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == _reference(models, name)
    assert llm.engine.kv_cache.is_empty()


def test_norm_topk_prob_decides_whether_the_weights_are_renormalised(models, tmp_path) -> None:
    """The same weights with norm_topk_prob turned on: transformers' output changes, and the
    engine's with it."""
    from transformers import Qwen3MoeForCausalLM

    folder = edit_config(models["qwen3-moe"][0], tmp_path / "normed", norm_topk_prob=True)
    hf = Qwen3MoeForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    expected = hf_greedy(hf, PROMPTS, MAX_TOKENS)
    assert expected != _reference(models, "qwen3-moe")
    llm = LLM(str(folder), **ENGINE)
    assert llm.model_config.moe.renormalize
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def _per_token_reference(experts: Experts, x, weights, ids) -> torch.Tensor:
    """Each token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += w * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_the_expert_formulations_agree_with_a_per_token_reference(tokens: int) -> None:
    """The grouped GEMMs (torch's grouped GEMM, and one matmul per expert with rows) and every
    expert over every token (what a CUDA graph runs without the grouped GEMM) compute each
    token's weighted sum of its experts, whichever experts get no token."""
    torch.manual_seed(tokens)
    experts = Experts(num_experts=8, hidden_size=32, intermediate_size=24, hidden_act="silu")
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
        x = torch.randn(tokens, 32)
        # Experts 0 and 5 are never chosen.
        choices = torch.tensor([1, 2, 3, 4, 6, 7])
        ids = choices[torch.stack([torch.randperm(6)[:2] for _ in range(tokens)])]
        weights = torch.rand(tokens, 2)
        expected = _per_token_reference(experts, x, weights, ids)
        assert grouped_mm_runs(x, experts.gate_up_proj)
        torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            experts.every_expert(x, weights, ids), expected, atol=1e-5, rtol=1e-5
        )
        # One matmul per expert with rows: what runs where the grouped GEMM does not.
        order = torch.sort(ids.reshape(-1), stable=True)
        ends = torch.searchsorted(order.values, torch.arange(1, 9), out_int32=True)
        rows = x[order.indices // 2]
        torch.testing.assert_close(
            linear_per_group(rows, experts.gate_up_proj, ends),
            torch.einsum("rh,rih->ri", rows, experts.gate_up_proj[order.values]),
            atol=1e-5,
            rtol=1e-5,
        )
    # Rows whose width is not a multiple of 16 bytes take the per-expert matmuls.
    assert not grouped_mm_runs(torch.randn(3, 7), torch.randn(2, 5, 7))


@pytest.fixture(scope="module")
def trained_draft(models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-depth draft for the Qwen3-MoE target (a dense layer among its sparse ones), trained
    by `pdcluster train-draft` for a few hundred steps on the target's answers to 200 prompts
    (about 15 s): enough to accept some drafts."""
    from cluster.commands.cli import main

    root = tmp_path_factory.mktemp("moe-draft")
    target = root / "target"
    shutil.copytree(models["qwen3-moe"][0], target)
    save_chat_template(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads waiting for one another cost more
    try:
        # fmt: off
        code = main([
            "train-draft", "--out", str(root / "run"), "--model", str(target),
            "--device", "cpu", "--num-prompts", "200", "--self-prompts", "0",
            "--num-heldout", "2", "--max-tokens", "16", "--epochs", "3",
            "--tokens-per-batch", "256", "--lr", "3e-3", "--warmup-steps", "5",
            "--num-draft-steps", "3", "--no-progress", "--no-evaluate",
        ])
        # fmt: on
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return root / "run" / "draft"


@pytest.mark.parametrize(
    "tree", [{}, {"speculative_topk": 2, "num_draft_tokens": 6}], ids=["chain", "tree"]
)
def test_speculation_with_a_trained_draft_is_lossless(models, trained_draft, tree) -> None:
    """The draft's depths are dense layers (no experts) with the target's attention: Qwen3's
    query and key norms. Verify runs the experts over the newest token and the drafts."""
    from safetensors import safe_open

    with safe_open(str(trained_draft / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert "depths.0.layer.self_attn.k_norm.weight" in names
    assert "depths.0.layer.mlp.gate_proj.weight" in names
    assert not any("experts" in name or "mlp.gate.weight" in name for name in names)
    llm = LLM(
        str(models["qwen3-moe"][0]),
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(trained_draft),
        num_draft_steps=3,
        **tree,
        **ENGINE,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == _reference(models, "qwen3-moe")
    totals = spec_totals(o.usage for o in outputs)
    assert totals.verify_steps > 0 and totals.accepted_tokens > 0
    assert llm.engine.kv_cache.is_empty()


def test_tensor_dump_holds_the_router_logits_and_the_experts_output(models, tmp_path) -> None:
    path, hf = models["qwen3-moe"]
    llm = LLM(str(path), debug_tensor_dump_dir=str(tmp_path), **ENGINE)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
    first = tmp_path / "offline" / "target" / "rank0" / "forward_000000.pt"
    outputs = torch.load(first, weights_only=True)["outputs"]
    tokens, hidden = len(PROMPTS[0]), llm.model_config.hidden_size
    assert outputs["model.layers.0.mlp.gate"].shape == (tokens, 6)
    assert outputs["model.layers.0.mlp.experts"].shape == (tokens, hidden)
    assert outputs["model.layers.1.mlp.down_proj"].shape == (tokens, hidden)  # the dense layer
    # The router's logits are transformers' own.
    captured = []
    hook = hf.model.layers[2].mlp.gate.register_forward_hook(
        lambda module, args, out: captured.append(out[0])
    )
    with torch.no_grad():
        hf(torch.tensor([PROMPTS[0]]))
    hook.remove()
    torch.testing.assert_close(
        outputs["model.layers.2.mlp.gate"], captured[0], atol=1e-4, rtol=1e-4
    )


def test_a_qwen3_moe_gguf_file_converts_into_the_same_model(tmp_path, monkeypatch) -> None:
    """transformers converts a Qwen3-MoE GGUF file (its experts one tensor per projection) into
    a Qwen3MoeForCausalLM folder, with Qwen3MoeConfig's expert width (768) and the top-k
    weights renormalised, as llama.cpp runs such files."""
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_tiny_family(
        tmp_path / "folder", "qwen3_moe", seed=1, moe_intermediate_size=768, norm_topk_prob=True
    )
    from_gguf = LLM(str(write_tiny_gguf(hf, tmp_path / "qwen3moe.gguf")), **ENGINE)
    config = from_gguf.model_config
    assert config.moe == MoeConfig(6, 2, 768, renormalize=True, sparse_layers=(0, 1))
    assert [o.token_ids for o in from_gguf.generate(PROMPTS, GREEDY)] == hf_greedy(
        hf, PROMPTS, MAX_TOKENS
    )


def test_moe_gguf_files_that_would_convert_wrongly_are_refused(tmp_path, monkeypatch) -> None:
    """A `llama` GGUF file with experts (Mixtral's) would become a dense Llama with random MLP
    weights; a `qwen3moe` file whose experts are not 768 wide would not load in transformers."""
    import gguf

    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path / "cache"))
    mixtral = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(str(mixtral), "llama")
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'llama' with 8 experts.*HF folder"):
        LLM(str(mixtral), **ENGINE)
    hf = make_tiny_family(tmp_path / "folder", "qwen3_moe", seed=1)
    narrow = write_tiny_gguf(hf, tmp_path / "narrow.gguf")
    with pytest.raises(UnsupportedModelError, match="experts are 48 wide.*768 wide"):
        LLM(str(narrow), **ENGINE)
    assert not any((tmp_path / "cache" / "models").glob("*/config.json"))


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
            "Qwen2MoeForCausalLM is not supported; Qwen2MoeForCausalLM: shared experts",
        ),
        ({"shared_expert_intermediate_size": 32}, "shared experts are not supported"),
    ],
    ids=["qwen2-moe", "shared-expert"],
)
def test_what_is_not_run_is_refused(models, tmp_path, fields: dict, message: str) -> None:
    folder = edit_config(models["qwen3-moe"][0], tmp_path / "edited", **fields)
    with pytest.raises(UnsupportedModelError, match=message) as raised:
        LLM(str(folder), **ENGINE)
    if "architectures" in fields:
        assert all(name in str(raised.value) for name in SUPPORTED_ARCHITECTURES)


def test_a_checkpoint_that_lacks_an_expert_is_refused(models, tmp_path) -> None:
    folder = tmp_path / "lacking"
    shutil.copytree(models["mixtral"][0], folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights.*layers\.1\.mlp\.experts"):
        LLM(str(folder), **ENGINE)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_the_gpu_path_gives_transformers_output(models, name: str) -> None:
    """On a GPU in float32 the grouped GEMM does not run: eager steps take one matmul per
    expert, and the steps captured in CUDA graphs run every expert over every token."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for chunk in (0, 16):
        llm = LLM(
            str(models[name][0]),
            device="cuda",
            dtype="float32",
            kv_cache_tokens=2048,
            chunked_prefill_size=chunk,
        )
        assert llm.config.cuda_graph_max_bs > 0
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == _reference(models, name)
