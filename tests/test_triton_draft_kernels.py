"""The kernels a draft depth's forward takes on a GPU against the torch code they replace: the
top-1 proposal with its probability (in place of softmax, max and the vocabulary lookup), a
tree node's top-k proposals with theirs (in place of softmax, top-k and the lookup), the
RMSNorm written into a slice of a wider tensor (the depth's fc input without a concatenation),
and the rotary table looked up in the model's dtype. GPU only; the CPU keeps the torch code."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import triton_runs_on

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_runs_on("cuda"), reason="needs CUDA and Triton"),
]


def _config(vocab_size: int):
    from engine.model_config import ModelConfig, RopeConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=64,
        intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-5, max_position_embeddings=256, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True,
    )  # fmt: skip


def _torch_top1(logits: torch.Tensor, vocab: torch.Tensor | None):
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top = probs.max(dim=-1, keepdim=True)
    return (top if vocab is None else vocab[top]), top_p


@pytest.mark.parametrize("size", [7, 1000, 8192, 49152])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_vocab", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_top1_matches_softmax_and_max(size: int, dtype, with_vocab: bool, split: bool) -> None:
    from engine.kernels.top1 import top1_with_probability

    torch.manual_seed(size)
    logits = (4 * torch.randn(33, size, device="cuda")).to(dtype)
    vocab = None
    if with_vocab:
        vocab = torch.randperm(3 * size, device="cuda")[:size].sort().values
    ids, probs = top1_with_probability(logits, vocab, split)
    expected_ids, expected_probs = _torch_top1(logits, vocab)
    assert ids.dtype == torch.int64 and ids.shape == (33, 1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("split", [False, True])
def test_top1_takes_the_first_of_tied_maxima_and_strided_rows(split: bool) -> None:
    from engine.kernels.top1 import top1_with_probability

    wide = torch.zeros(3, 9000, device="cuda", dtype=torch.bfloat16)
    logits = wide[:, :5000]  # rows 9000 apart
    logits[0, [17, 4000, 4999]] = 3.0  # tied, in different blocks and lanes
    logits[1, 4999] = 1.0
    logits[2] = -1.0  # all equal: the first wins, probability 1 / 5000
    ids, probs = top1_with_probability(logits, None, split)
    assert ids[:, 0].tolist() == [17, 4999, 0]
    expected_ids, expected_probs = _torch_top1(logits, None)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(probs, expected_probs, atol=1e-7, rtol=1e-5)


def _reference_topk(logits: torch.Tensor, k: int, vocab: torch.Tensor | None):
    """Largest logits first, equal ones lowest index first (a stable descending sort), with
    their softmax probabilities."""
    full = logits.float()
    top = full.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    probs = torch.softmax(full, dim=-1).gather(1, top)
    return (top if vocab is None else vocab[top]), probs


@pytest.mark.parametrize("size", [7, 1000, 8192, 20000, 49152])
@pytest.mark.parametrize("k", [2, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_vocab", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_topk_matches_a_stable_sort_and_softmax(
    size: int, k: int, dtype, with_vocab, split
) -> None:
    from engine.kernels.topk import topk_with_probability

    k = min(k, size)
    torch.manual_seed(size + k)
    # In bfloat16 many of 4 * randn's values repeat: ties inside and across blocks.
    logits = (4 * torch.randn(21, size, device="cuda")).to(dtype)
    vocab = None
    if with_vocab:
        vocab = torch.randperm(3 * size, device="cuda")[:size].sort().values
    ids, probs = topk_with_probability(logits, k, vocab, split)
    expected_ids, expected_probs = _reference_topk(logits, k, vocab)
    assert ids.dtype == torch.int64 and ids.shape == (21, k) and probs.shape == (21, k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("split", [False, True])
def test_topk_ties_strided_rows_and_infinite_logits(split: bool) -> None:
    from engine.kernels.topk import topk_with_probability

    wide = torch.full((3, 30000), -2.0, device="cuda", dtype=torch.bfloat16)
    logits = wide[:, :20000]  # rows 30000 apart, each over three blocks of 8192
    logits[0, [19999, 8192, 17, 9000]] = 5.0  # tied maxima in three blocks
    logits[1] = float("-inf")
    logits[1, [3, 12000]] = 1.0  # two finite logits: the rest of the top are -inf, index order
    logits[2, 100] = float("inf")
    ids, probs = topk_with_probability(logits, 5, None, split)
    assert ids[0].tolist() == [17, 8192, 9000, 19999, 0]
    assert ids[1].tolist() == [3, 12000, 0, 1, 2]
    torch.testing.assert_close(probs[1, :2], torch.full((2,), 0.5, device="cuda"))
    assert probs[1, 2:].tolist() == [0.0, 0.0, 0.0]
    expected_ids, expected_probs = _reference_topk(logits[:1], 5, None)
    assert torch.equal(ids[:1], expected_ids)
    torch.testing.assert_close(probs[:1], expected_probs, atol=1e-7, rtol=1e-5)
    assert ids[2, 0].item() == 100
    if split:  # a lone +inf takes all the probability; the one-program kernel gives NaN
        assert probs[2, 0].item() == 1.0


@pytest.mark.parametrize("split", [False, True])
def test_topk_of_nan_logits_names_real_tokens(split: bool) -> None:
    """A broken model's NaN logits count as -inf: the ids stay inside the vocabulary (the next
    embedding lookup reads them), the finite logits first."""
    from engine.kernels.topk import topk_with_probability

    logits = torch.full((2, 10000), float("nan"), device="cuda")
    logits[1, [9000, 5]] = 2.0
    vocab = torch.arange(10000, device="cuda") * 3
    ids, _ = topk_with_probability(logits, 4, vocab, split)
    assert ids[0].tolist() == [0, 3, 6, 9]
    assert ids[1].tolist() == [15, 27000, 0, 3]


def test_draft_head_proposes_what_the_torch_path_proposes() -> None:
    from engine.models.llama import LlamaForCausalLM
    from spec.draft_vocab import DraftHead

    torch.manual_seed(0)
    target = LlamaForCausalLM(_config(3000)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.5)
    hidden = torch.randn(9, 64, device="cuda", dtype=torch.bfloat16)
    for vocab in (None, torch.arange(0, 3000, 3, device="cuda")):
        head = DraftHead(target, vocab)
        with torch.inference_mode():
            ids, probs = head.propose_top(hidden, 1)
            expected_ids, expected_probs = _torch_top1(head._logits(hidden), head.vocab)
            tree_ids, tree_probs = head.propose_top(hidden, 8)
            expected_tree = _reference_topk(head._logits(hidden), 8, head.vocab)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)
        assert torch.equal(tree_ids, expected_tree[0])
        torch.testing.assert_close(tree_probs, expected_tree[1], atol=1e-6, rtol=1e-5)


def test_rms_norm_into_a_column_slice() -> None:
    from engine.kernels.elementwise import rms_norm

    x = torch.randn(11, 576, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(576, device="cuda", dtype=torch.bfloat16) + 0.5
    joined = torch.full((11, 1152), 7.0, device="cuda", dtype=torch.bfloat16)
    out, _ = rms_norm(x, weight, 1e-5, out=joined[:, 576:])
    assert out.data_ptr() == joined[:, 576:].data_ptr()
    assert torch.equal(joined[:, 576:], rms_norm(x, weight, 1e-5)[0])
    assert bool((joined[:, :576] == 7.0).all())


def test_draft_depth_input_equals_the_concatenation() -> None:
    from spec.draft_model import DraftDepth

    torch.manual_seed(1)
    depth = DraftDepth(_config(100), 96).to("cuda", torch.bfloat16)
    with torch.no_grad():
        depth.enorm.weight.uniform_(0.5, 1.5)
        depth.hnorm.weight.uniform_(0.5, 1.5)
    embeds = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        joined = depth.fc_input(embeds, hidden)
        expected = torch.cat([depth.enorm(embeds), depth.hnorm(hidden)], dim=-1)
    assert torch.equal(joined, expected)


def test_hooked_draft_norms_run_as_modules() -> None:
    """A tensor dump hooks every part of a depth: with hooks on its norms, the depth calls
    them as modules (each hook sees its output) instead of writing fc's input in kernels."""
    from spec.draft_model import DraftDepth

    depth = DraftDepth(_config(100), 96).to("cuda", torch.bfloat16)
    seen = []
    for norm in (depth.enorm, depth.hnorm):
        norm.register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    embeds = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        joined = depth.fc_input(embeds, hidden)
    assert len(seen) == 2
    assert torch.equal(joined, torch.cat(seen, dim=-1))


def test_rotary_lookup_in_the_model_dtype() -> None:
    from engine.model_config import RopeConfig
    from engine.models.rope import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 512, "cuda")
    positions = torch.tensor([0, 5, 511, 5], device="cuda")
    cos, sin = rotary.lookup(positions, torch.bfloat16)
    assert cos.shape == sin.shape == (4, 1, 64) and cos.dtype == torch.bfloat16
    full_cos, full_sin = rotary.lookup(positions, torch.float32)
    assert torch.equal(cos, full_cos.to(torch.bfloat16))
    assert torch.equal(sin, full_sin.to(torch.bfloat16))
    again = rotary.lookup(positions, torch.bfloat16)
    assert torch.equal(again[0], cos) and torch.equal(again[1], sin)


@pytest.mark.parametrize("split", [False, True])
def test_top1_of_nan_and_infinite_logits_names_real_tokens(split: bool) -> None:
    from engine.kernels.top1 import top1_with_probability

    logits = torch.zeros(2, 20000, device="cuda")
    logits[0, [7, 15000]] = float("nan")
    logits[0, 9000] = 3.0
    logits[1, 12345] = float("inf")
    ids, probs = top1_with_probability(logits, None, split)
    assert ids[:, 0].tolist() == [9000, 12345]
    assert probs[1, 0].item() == 1.0
    if split:  # NaN counts as -inf there: the rest of the row shares the probability
        expected = torch.softmax(torch.where(logits[0].isnan(), -torch.inf, logits[0]), -1)
        torch.testing.assert_close(probs[0, 0], expected[9000])


def test_long_rows_are_split_and_short_ones_are_not(monkeypatch) -> None:
    from engine.kernels import top1, topk

    split_calls: list[tuple[int, int]] = []
    original = top1.split_topk_into

    def recording(logits, k, vocab, ids, probs):
        split_calls.append((logits.shape[1], k))
        original(logits, k, vocab, ids, probs)

    monkeypatch.setattr(top1, "split_topk_into", recording)
    monkeypatch.setattr(topk, "split_topk_into", recording)
    for k, limit in ((1, top1.SPLIT_ABOVE), (8, topk.SPLIT_ABOVE)):
        for size in (limit, limit + 1):
            topk.topk_with_probability(torch.randn(3, size, device="cuda"), k)
    assert split_calls == [(top1.SPLIT_ABOVE + 1, 1), (topk.SPLIT_ABOVE + 1, 8)]
