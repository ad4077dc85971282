"""A draft vocabulary (spec.draft_vocab): chosen from token counts, stored in the draft folder,
and used by every depth to propose tokens from those ids alone, without changing the output."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_drafts import make_good_draft, make_predictable_llama, target_config
from tiny_models import make_tiny_llama

from cluster.commands.cli import build_parser
from cluster.commands.cli_commands import engine_args
from engine import LLM, ModelLoadError, SamplingParams
from engine.executor.model_runner import build_model
from engine.loading.loader import EngineArgs, resolve
from engine.loading.weights import iter_safetensors
from engine.models.cpu_linear import PackedLinear, packed_linear_available
from engine.request import spec_totals
from spec import MultiLayerEagleDraft, load_draft, save_draft
from spec.draft_model import VOCAB_TENSOR
from spec.draft_vocab import DraftHead, choose_draft_vocab, count_tokens, coverage

SPEC = "multi-layer-eagle"


# --- choosing ---------------------------------------------------------------------------------


def test_the_most_frequent_tokens_are_chosen_in_ascending_order() -> None:
    counts = count_tokens([[5, 5, 5, 2, 2, 7], [7, 7, 7, 9]], 10)
    assert counts.tolist() == [0, 0, 2, 0, 0, 3, 0, 4, 0, 1]
    assert choose_draft_vocab(counts, 2).tolist() == [5, 7]
    assert choose_draft_vocab(counts, 3).tolist() == [2, 5, 7]
    # Ties go to the lower id, so the choice does not depend on anything but the counts.
    assert choose_draft_vocab(counts, 5).tolist() == [0, 2, 5, 7, 9]
    assert coverage(counts, torch.tensor([5, 7])) == pytest.approx(7 / 10)


def test_end_of_turn_tokens_are_always_in() -> None:
    counts = count_tokens([[5, 5, 7, 7, 3]], 10)
    assert choose_draft_vocab(counts, 2, always=[1]).tolist() == [1, 5]
    with pytest.raises(ValueError, match="vocabulary size"):
        choose_draft_vocab(counts, 11)
    with pytest.raises(ValueError, match="below the vocabulary size"):
        choose_draft_vocab(counts, 2, always=[10])


# --- the folder format ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("draft_vocab") / "target"
    make_tiny_llama(path, seed=0)
    return path


def test_a_vocabulary_survives_the_round_trip(target: Path, tmp_path: Path) -> None:
    config = target_config(target)
    vocab = torch.tensor([2, 3, 40, 41, 300])
    save_draft(tmp_path / "d", MultiLayerEagleDraft(config, 2, vocab))
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 5
    loaded = load_draft(tmp_path / "d", config, None, "cpu", torch.float32)
    assert torch.equal(loaded.vocab, vocab)
    save_draft(tmp_path / "full", MultiLayerEagleDraft(config, 2))
    assert "draft_vocab_size" not in json.loads((tmp_path / "full" / "config.json").read_text())
    assert load_draft(tmp_path / "full", config, None, "cpu", torch.float32).vocab is None


@pytest.mark.parametrize(
    "vocab, size, message",
    [
        (torch.tensor([3, 2, 40]), 3, "ascending"),
        (torch.tensor([2, 3, 3]), 3, "ascending"),
        (torch.tensor([2, 3, 320]), 3, "outside"),
        (torch.tensor([2, 3, 40]), 4, "config.json says 4"),
        (torch.tensor([2.0, 3.0]), 2, "int64"),
        (None, 3, "has no 'draft_vocab' tensor"),
    ],
)
def test_a_broken_vocabulary_is_refused(
    target: Path, tmp_path: Path, vocab, size: int, message: str
) -> None:
    config = target_config(target)
    folder = tmp_path / "d"
    save_draft(folder, MultiLayerEagleDraft(config, 1, torch.tensor([2, 3, 40])))
    tensors = load_file(str(folder / "model.safetensors"))
    if vocab is None:
        del tensors[VOCAB_TENSOR]
    else:
        tensors[VOCAB_TENSOR] = vocab
    save_file(tensors, str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    raw["draft_vocab_size"] = size
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=message):
        load_draft(folder, config, None, "cpu", torch.float32)


def test_a_vocabulary_the_config_does_not_declare_is_refused(target: Path, tmp_path: Path):
    config = target_config(target)
    folder = tmp_path / "d"
    save_draft(folder, MultiLayerEagleDraft(config, 1, torch.tensor([2, 3])))
    raw = json.loads((folder / "config.json").read_text())
    del raw["draft_vocab_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="unexpected weight 'draft_vocab'"):
        load_draft(folder, config, None, "cpu", torch.float32)


# --- proposing --------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_head_proposes_the_best_token_of_the_vocabulary(
    tmp_path: Path, tied: bool, packed: bool
) -> None:
    make_tiny_llama(tmp_path / "t", seed=2, tie_word_embeddings=tied)
    spec = resolve(EngineArgs(model=str(tmp_path / "t"), device="cpu"))
    engine_config = dataclasses.replace(spec.engine_config, cpu_packed_linear=packed)
    model = build_model(spec.model_config, engine_config, iter_safetensors(spec.path))
    assert isinstance(model.lm_head, PackedLinear) == (
        packed and packed_linear_available(torch.device("cpu"), torch.float32)
    )
    torch.manual_seed(0)
    hidden = torch.randn(6, model.config.hidden_size)
    full = model.lm_head_logits(hidden)
    vocab = torch.arange(1, 320, 3)
    ids, probs = DraftHead(model, vocab).propose(hidden)
    masked = torch.full_like(full, float("-inf"))
    masked[:, vocab] = full[:, vocab]
    assert ids.tolist() == masked.argmax(-1).tolist()
    torch.testing.assert_close(probs, torch.softmax(masked, -1).max(-1).values)
    assert DraftHead(model, vocab).argmax(hidden).tolist() == ids.tolist()
    # Without a vocabulary: the whole head.
    assert DraftHead(model, None).propose(hidden)[0].tolist() == full.argmax(-1).tolist()


@pytest.fixture(scope="module")
def predictable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vocab_engine")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.01)
    return root / "target", root / "draft"


def _with_vocab(draft: Path, target: Path, vocab: torch.Tensor, out: Path) -> Path:
    loaded = load_draft(draft, target_config(target), None, "cpu", torch.float32)
    loaded.vocab = vocab
    save_draft(out, loaded)
    return out


def _speculate(
    target: Path, draft: Path, prompts, params, draft_vocab: str | None = None
) -> tuple[list[list[int]], float, set]:
    llm = LLM(
        str(target),
        device="cpu",
        kv_cache_tokens=4096,
        max_num_seqs=8,
        speculative_algorithm=SPEC,
        draft_model=str(draft),
        draft_vocab=draft_vocab,
    )
    proposed: set[int] = set()
    head = llm.engine.speculator.head
    propose = head.propose

    def recording(hidden):
        ids, probs = propose(hidden)
        proposed.update(ids.tolist())
        return ids, probs

    head.propose = recording
    outputs = llm.generate(prompts, params)
    totals = spec_totals(o.usage for o in outputs)
    return [o.token_ids for o in outputs], totals.accept_length, proposed


def test_speculation_with_a_vocabulary_keeps_the_output(predictable, tmp_path: Path) -> None:
    target, draft = predictable
    prompts = [[3 + (7 * i + j) % 300 for j in range(5 + i)] for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target), device="cpu").generate(prompts, params)]
    emitted = count_tokens(plain, 320)

    full_out, full_accept, _ = _speculate(target, draft, prompts, params)
    # Every token the target emits, and nothing else: the draft loses no right proposal.
    covering = torch.nonzero(emitted).flatten()
    cover_out, cover_accept, cover_ids = _speculate(
        target, _with_vocab(draft, target, covering, tmp_path / "cover"), prompts, params
    )
    # Without the target's ten most frequent tokens: fewer proposals can be right.
    frequent = set(torch.argsort(emitted, descending=True)[:10].tolist())
    rest = torch.tensor([t for t in range(320) if t not in frequent])
    cut_out, cut_accept, cut_ids = _speculate(
        target, _with_vocab(draft, target, rest, tmp_path / "cut"), prompts, params
    )
    assert full_out == cover_out == cut_out == plain
    assert cover_ids <= set(covering.tolist())
    assert cut_ids.isdisjoint(frequent)
    assert full_accept > 1.5
    assert cover_accept >= full_accept
    assert cut_accept < full_accept - 0.3

    # The same cut folder, told to ignore its vocabulary, proposes what the whole head does.
    uncut_out, uncut_accept, _ = _speculate(
        target, tmp_path / "cut", prompts, params, draft_vocab="full"
    )
    assert uncut_out == plain
    assert uncut_accept == pytest.approx(full_accept)


# --- choosing it per engine -------------------------------------------------------------------


def test_a_cpu_engine_keeps_the_draft_vocabulary_unless_told_otherwise(predictable) -> None:
    target, draft = predictable
    common = {"model": str(target), "device": "cpu", "speculative_algorithm": SPEC}
    assert resolve(EngineArgs(**common, draft_model=str(draft))).engine_config.draft_vocab == (
        "draft"
    )
    full = resolve(EngineArgs(**common, draft_model=str(draft), draft_vocab="full"))
    assert full.engine_config.draft_vocab == "full"


def test_a_gpu_engine_proposes_from_the_whole_vocabulary_by_default(predictable) -> None:
    # Resolving reads no GPU when the KV pool's size is given: this runs anywhere.
    target, draft = predictable
    common = {"model": str(target), "device": "cuda", "kv_cache_tokens": 64}
    spec = {"speculative_algorithm": SPEC, "draft_model": str(draft)}
    assert resolve(EngineArgs(**common, **spec)).engine_config.draft_vocab == "full"
    keep = resolve(EngineArgs(**common, **spec, draft_vocab="draft"))
    assert keep.engine_config.draft_vocab == "draft"


def test_a_bad_draft_vocab_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="draft_vocab must be one of draft, full, got 'half'"):
        EngineArgs(speculative_algorithm=SPEC, draft_vocab="half")
    with pytest.raises(ValueError, match="draft_vocab needs a speculative_algorithm"):
        EngineArgs(draft_vocab="full")


def test_the_draft_vocab_flag_reaches_the_engine_and_a_bad_one_is_a_message(capsys) -> None:
    flags = ["--speculative-algorithm", SPEC, "--draft-vocab", "full"]
    assert engine_args(build_parser().parse_args(["serve", *flags])).draft_vocab == "full"
    assert engine_args(build_parser().parse_args(["serve"])).draft_vocab is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-algorithm", SPEC, "--draft-vocab", "x"])
    assert "invalid choice: 'x'" in capsys.readouterr().err
