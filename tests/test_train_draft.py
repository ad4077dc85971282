"""`pdcluster train-draft` (spec/train): the dense teacher-forced forwards equal the engine's,
training raises the held-out accept length, its replay equals the engine's own count, and
compared drafts run on the same engine (the command line: test_train_draft_cli.py; the
generated data: test_train_data.py; batching and the replay's rules: test_trainer_rules.py;
resuming a run: test_train_resume.py; which draft an engine speculates with:
test_draft_resolution.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_drafts import make_eagle3_draft, make_random_draft
from tiny_families import make_tiny_family
from tiny_models import make_tiny_llama
from train_helpers import checkpoint, read_log

from engine import LLM
from engine.errors import ModelLoadError
from engine.executor.model_runner import build_model
from engine.loading.loader import EngineArgs, resolve
from engine.loading.weights import iter_safetensors
from engine.models.rope import RotaryEmbedding
from spec import load_draft
from spec.draft_model import MultiLayerEagleDraft
from spec.runtime.batching import Span, extend_batch
from spec.runtime.draft_runner import DraftInput, DraftSeq
from spec.train.batches import make_block
from spec.train.data import Sequences
from spec.train.dense import draft_forward, target_forward
from spec.train.pipeline import HELDOUT_CHAINS, TrainDraftConfig, train_draft
from spec.train.trainer import Schedule, distillation_step

NUM_DRAFT_STEPS = 3
DRAFT_VOCAB_SIZE = 200
# One CPU thread, and the predictable target: conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


# --- 1. the dense forwards compute what the engine computes -------------------------------


@pytest.fixture(scope="module", params=["last-layer", "aux-layers", "gemma3"])
def speculating_llm(request, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """An engine on a 2-layer tiny Llama with a random 3-depth draft; depth 0 reads the last
    layer's output, or (EAGLE3 style) both layers' outputs side by side. Or on a tiny Gemma 3
    whose window (4) is shorter than the sequences below: its sliding layers, and the draft's
    depths (layers of that kind), attend to the window, and its embeddings are scaled."""
    root = tmp_path_factory.mktemp("parity")
    target = root / "target"
    if request.param == "gemma3":
        make_tiny_family(
            target,
            "gemma3",
            seed=1,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
        )
    else:
        make_tiny_llama(target, seed=1)
    draft = root / "draft"
    if request.param == "aux-layers":
        make_eagle3_draft(draft, target, NUM_DRAFT_STEPS, (0, 1), seed=2)
    else:
        make_random_draft(draft, target, NUM_DRAFT_STEPS, seed=2)
    return LLM(
        str(target),
        device="cpu",
        max_num_seqs=4,
        max_model_len=128,
        kv_cache_tokens=512,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
    )


def test_dense_forwards_match_the_engine_runners(speculating_llm: LLM) -> None:
    runner = speculating_llm.engine.runner
    worker = speculating_llm.engine.speculator
    draft = SimpleNamespace(depths=[depth_runner.module for depth_runner in worker.depths])
    generator = torch.Generator().manual_seed(0)
    length = 13
    x = torch.randint(3, runner.model_config.vocab_size, (length,), generator=generator)
    ids = x.tolist()

    # The engine: the target's prefill over x through the paged KV cache, hidden kept.
    row = runner.req_to_token_pool.allocate_row()
    slots = runner.kv_pool.allocator.allocate(length)
    runner.req_to_token_pool.write(row, 0, slots)
    batch = extend_batch(
        [Span(row, 0, ids, slots)],
        runner.kv_pool,
        runner.req_to_token_pool,
        runner.attention,
        runner.device,
    )
    engine_out = runner.forward(batch, keep_hidden=True)
    engine_hidden = engine_out.hidden
    runner.kv_pool.allocator.free(slots)
    runner.req_to_token_pool.free_row(row)
    assert engine_hidden.shape == (length, runner.model_config.spec_hidden_size)

    # The trainer's dense forwards, through the same modules.
    with torch.no_grad():
        dense_hidden, last = target_forward(runner.model, runner.rotary, x[None])
        dense_outputs = draft_forward(draft, runner.model, runner.rotary, x[None], dense_hidden)
    torch.testing.assert_close(dense_hidden, engine_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        runner.model.lm_head_logits(last)[-1:], engine_out.logits, atol=1e-4, rtol=1e-4
    )

    # Each depth's engine runner from position 0: depth d reads x[d+1:] and the hidden states
    # the depth before it produced at the same positions.
    hidden = engine_hidden
    for d, depth_runner in enumerate(worker.depths):
        n = length - d - 1
        seq = DraftSeq()
        (out,) = depth_runner.forward([DraftInput(seq, 0, ids[d + 1 : d + 1 + n], (hidden[:n],))])
        depth_runner.release(seq)
        assert out.shape == (n, runner.model_config.hidden_size)
        torch.testing.assert_close(dense_outputs[d][:n], out, atol=1e-5, rtol=1e-5)
        hidden = out
    assert worker.is_empty()


def test_distillation_step_scores_each_depth_on_its_answer_positions(
    speculating_llm: LLM,
) -> None:
    """The step's loss and agreement per depth against a reference written out per row:
    depth d at position i learns the target's distribution at i+d+1, where x[i+d+2] is an
    answer token. Rows of different lengths and prompts share one padded block."""
    runner = speculating_llm.engine.runner
    worker = speculating_llm.engine.speculator
    draft = SimpleNamespace(depths=[depth_runner.module for depth_runner in worker.depths])
    generator = torch.Generator().manual_seed(3)
    vocab = runner.model_config.vocab_size
    rows = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (14, 9, 12)]
    data = Sequences(rows, [4, 6, 3], {})
    block = make_block(data, [0, 1, 2], 1024, torch.device("cpu"))
    with torch.no_grad():
        result = distillation_step(draft, runner.model, runner.rotary, block)
        hidden, last = target_forward(runner.model, runner.rotary, block.tokens)
        outputs = draft_forward(draft, runner.model, runner.rotary, block.tokens, hidden)
    width = block.tokens.shape[1]
    target_logits = runner.model.lm_head_logits(last).view(len(rows), width, -1)
    for d, out in enumerate(outputs):
        logits = runner.model.lm_head_logits(out).view(len(rows), width, -1)
        losses, agreements = [], []
        for b, (row, prompt_len) in enumerate(zip(rows, data.prompt_lens)):
            for i in range(len(row)):
                if prompt_len <= i + d + 2 <= len(row) - 1:
                    labels = target_logits[b, i + d + 1]
                    log_p = torch.log_softmax(logits[b, i], -1)
                    losses.append(-(torch.softmax(labels, -1) * log_p).sum())
                    agreements.append(float(logits[b, i].argmax() == labels.argmax()))
        assert result.num_positions[d] == len(losses)
        assert result.depth_loss[d] == pytest.approx(
            float(torch.stack(losses).mean().detach()), rel=1e-5
        )
        assert result.depth_accuracy[d] == pytest.approx(sum(agreements) / len(agreements))
    assert float(result.loss) == pytest.approx(sum(result.depth_loss), rel=1e-5)
    with torch.no_grad():
        decayed = distillation_step(draft, runner.model, runner.rotary, block, depth_loss_decay=0.5)
    assert decayed.depth_loss == pytest.approx(result.depth_loss, rel=1e-6)
    weighted = sum(0.5**d * loss for d, loss in enumerate(result.depth_loss))
    assert float(decayed.loss) == pytest.approx(weighted, rel=1e-5)


@pytest.mark.parametrize("detach", [False, True], ids=["joined", "detached"])
def test_detached_depths_train_on_their_own_loss_alone(predictable_path: Path, detach) -> None:
    """With detach_between_depths, depth 0's gradient is that of its own loss (what a draft
    of depth 0 alone gets); without it, the later depths' losses reach it too."""
    spec = resolve(EngineArgs(model=str(predictable_path), device="cpu"))
    # As the trainer builds it: plain weights, which a backward pass goes through.
    engine_config = dataclasses.replace(spec.engine_config, cpu_packed_linear=False)
    target = build_model(spec.model_config, engine_config, iter_safetensors(spec.path))
    target.requires_grad_(False)
    rotary = RotaryEmbedding(spec.model_config.rope, spec.model_config.head_dim, 1024, "cpu")
    torch.manual_seed(5)
    both = MultiLayerEagleDraft(spec.model_config, 2)
    alone = MultiLayerEagleDraft(spec.model_config, 1)
    alone.depths[0].load_state_dict(both.depths[0].state_dict())
    rows = [list(range(3, 17)), list(range(20, 31))]
    block = make_block(Sequences(rows, [4, 3], {}), [0, 1], 1024, torch.device("cpu"))
    grads = []
    for draft in (both, alone):
        distillation_step(draft, target, rotary, block, detach).loss.backward()
        grads.append(draft.depths[0].fc.weight.grad)
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-7) == detach


# --- 2. training helps, and the trainer's replay is the engine's count ---------------------


def trained_config(out: Path, model: Path, **changes) -> TrainDraftConfig:
    return TrainDraftConfig(
        out_dir=out,
        model=str(model),
        device="cpu",
        num_prompts=128,
        num_heldout=8,
        max_tokens=24,
        generate_batch=32,
        schedule=Schedule(epochs=6, tokens_per_batch=2048, log_every=5, checkpoint_every=10),
        progress=False,
        save_dtype="float32",
        # Fewer than the 320 ids: the shipped draft proposes from a vocabulary.
        draft_vocab_size=DRAFT_VOCAB_SIZE,
        **changes,
    )


@pytest.fixture(scope="module")
def trained(predictable_path: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("trained")
    return out, train_draft(trained_config(out, predictable_path))


def test_training_raises_the_heldout_accept_length(trained) -> None:
    out, summary = trained
    final = summary["validations"][-1]
    assert len(summary["validations"]) == 6
    assert summary["validations"][0]["accept_length"] < 1.3  # a random draft: about 1
    assert final["accept_length"] > 1.8
    losses = [record for record in read_log(out) if "loss" in record]
    assert losses[-1]["loss"][0] < losses[0]["loss"][0]
    assert summary["final_train"] == losses[-1]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))


def test_replay_equals_the_engines_accept_length(trained) -> None:
    _, summary = trained
    vocab = summary["draft_vocab"]
    assert vocab["restricted"] and vocab["size"] == DRAFT_VOCAB_SIZE
    assert 0.5 < vocab["heldout_answer_coverage"] <= 1.0
    assert 0.5 < vocab["train_answer_coverage"] <= 1.0
    # The last epoch's replay proposed from every id; the shipped draft from its vocabulary.
    replay, engine = vocab["replay"], summary["engine_heldout"]
    assert engine["verify_steps"] == replay["verify_steps"] > 0
    assert abs(engine["accept_length"] - replay["accept_length"]) < 1e-9
    assert engine["acceptance"] == pytest.approx(replay["acceptance"], abs=1e-9)
    assert len(engine["acceptance"]) == NUM_DRAFT_STEPS
    # And with alternative chains: they start with the draft's next guesses for the first
    # position, which is accepted at least as often.
    chains = summary["engine_heldout_chains"]
    assert chains["draft_chains"] == HELDOUT_CHAINS > 1
    assert chains["acceptance"][0] >= engine["acceptance"][0]


def test_a_compared_draft_runs_on_the_same_engine_and_prompts(
    trained, predictable_path: Path, tmp_path: Path
) -> None:
    # The finished run again, in a copy, with its own draft to compare: the same weights on
    # the same engine and prompts give the same figures, under the compared draft's name.
    out, summary = trained
    again = tmp_path / "again"
    shutil.copytree(out, again)
    compared = tmp_path / "compared"
    shutil.copytree(out / "draft", compared)
    rerun = train_draft(trained_config(again, predictable_path, compare_drafts=(compared,)))
    assert rerun["resumed"] and rerun["steps"] == summary["steps"]
    (result,) = rerun["engine_heldout_compared"]
    assert result == {"draft": str(compared), **summary["engine_heldout"]}
    assert result["verify_steps"] > 0


def test_a_draft_that_does_not_fit_is_refused_before_any_work(
    predictable_path: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-target"
    make_tiny_llama(other, seed=3, hidden_size=48)
    mismatched = tmp_path / "mismatched"
    make_random_draft(mismatched, other, NUM_DRAFT_STEPS, seed=2)
    weightless = tmp_path / "weightless"
    make_random_draft(weightless, predictable_path, NUM_DRAFT_STEPS, seed=2)
    (weightless / "model.safetensors").unlink()
    out = tmp_path / "out"
    for folder, reason in (
        (tmp_path / "missing", "config"),
        (mismatched, "does not fit the target"),
        (weightless, "could not read draft weights"),
    ):
        with pytest.raises(ModelLoadError, match=f"--compare-draft {folder}: .*{reason}"):
            train_draft(trained_config(out, predictable_path, compare_drafts=(folder,)))
        assert not out.exists() or not any(out.iterdir())
    with pytest.raises(ValueError, match="needs the held-out evaluation"):
        trained_config(out, predictable_path, compare_drafts=(mismatched,), evaluate=False)


def test_saved_draft_loads_with_the_trained_weights(trained, predictable_path: Path) -> None:
    out, summary = trained
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["num_draft_steps"] == NUM_DRAFT_STEPS
    target = resolve(EngineArgs(model=str(predictable_path), device="cpu")).model_config
    draft = load_draft(out / "draft", target, None, "cpu", torch.float32)
    assert draft.num_draft_steps == NUM_DRAFT_STEPS
    assert config["draft_vocab_size"] == summary["draft_vocab"]["size"] == draft.vocab.numel()
    trained_state = checkpoint(out)["draft"]
    loaded = draft.state_dict()
    assert loaded.keys() == trained_state.keys()
    for name, tensor in trained_state.items():
        assert torch.equal(loaded[name], tensor), name
