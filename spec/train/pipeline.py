"""`pdcluster train-draft` end to end, in one output folder:

    self_prompts.json        user messages the target wrote (spec.train.self_prompts)
    answers.pt, self_answers.pt, heldout.pt
                             the target's greedy answers (spec.train.data), resumable
    checkpoint.pt            the draft and optimizer state (spec.train.trainer), resumable
    train_log.jsonl          losses and accuracies every few steps, a validation per epoch
    draft/                   the trained draft (docs/draft-format.md), 16-bit by default
    user_prompts.json, user_answers*.pt, user_heldout*.pt
                             a user's prompts and the target's answers (spec.train.user_answers)
    summary.json             data sizes, the corpus's mix (spec.train.corpus_report), time,
                             final losses, held-out accept length

`generate_only` stops once the data is made. `data_from` adds the answer files of other
output folders to the training data: several runs with their own seeds can generate in
parallel (on as many GPUs), and one trains on all of it.

The held-out prompts (spec.train.prompts.heldout_prompts, and a share of a user's prompts) are
never trained on. After training,
the engine itself decodes them with the new draft: its accept length is the figure to trust;
the trainer's replay (Validation) estimates the same number without running the loop."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.executor.model_runner import build_model
from engine.loading.loader import EngineArgs, resolve
from engine.loading.weights import iter_safetensors, model_fingerprint
from engine.model_config import ModelConfig
from engine.models.rope import RotaryEmbedding
from engine.request import spec_totals
from spec.config import draft_target_config
from spec.draft_model import MultiLayerEagleDraft, load_draft, save_draft
from spec.draft_vocab import choose_draft_vocab, count_tokens, coverage
from spec.train.corpus_report import CorpusPart, corpus_report
from spec.train.data import Sequences
from spec.train.generate import generate_data, load_data_from
from spec.train.run_config import HELDOUT_CHAINS, SAVE_DTYPES, TrainDraftConfig
from spec.train.steps import check_train_steps, stored_state, with_train_steps
from spec.train.trainer import CHECKPOINT_FILE, DraftTrainer

__all__ = ["HELDOUT_CHAINS", "TrainDraftConfig", "evaluate_draft", "train_draft"]


def evaluate_draft(
    model: str | None,
    draft_dir: Path,
    conversations: list[list[dict[str, str]]],
    max_tokens: int,
    device: str | None = None,
    dtype: str = "auto",
    num_draft_steps: int | None = None,
    batch: int = 16,
    num_draft_chains: int = 1,
) -> dict:
    """The engine's own greedy speculative decoding of `conversations` with the draft in
    `draft_dir`: accept length (tokens per verify step, bonus included) and, per draft position,
    the share of verify steps that accepted it. One chain by default: the draft's own
    agreement, which the replay measures too."""
    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        max_num_seqs=batch,
        speculative_algorithm="multi-layer-eagle",
        draft_model=draft_dir,
        num_draft_steps=num_draft_steps,
        num_draft_chains=num_draft_chains,
        # The folder as saved, on every device: its vocabulary is what the replay scores too.
        draft_vocab="draft",
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs = []
    for start in range(0, len(conversations), batch):
        outputs += llm.chat(conversations[start : start + batch], params)
    totals = spec_totals(out.usage for out in outputs)
    steps = totals.verify_steps
    return {
        "accept_length": totals.accept_length if steps else None,
        "acceptance": [c / steps for c in totals.accepted_per_position] if steps else [],
        "verify_steps": steps,
        "conversations": len(conversations),
        "max_tokens": max_tokens,
        "draft_chains": num_draft_chains,
    }


def train_draft(config: TrainDraftConfig) -> dict:
    """Generate (or reuse) the data, train (or resume), save the draft, evaluate; returns the
    summary also written to summary.json."""
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    args = EngineArgs(model=config.model, device=config.device, dtype=config.dtype)
    spec = resolve(args)
    # Loaded once here (on the CPU) so that a draft that cannot run is refused before hours of
    # generating and training, not after.
    for folder in config.compare_drafts:
        try:
            load_draft(
                folder, draft_target_config(spec.model_config, folder), None, "cpu", torch.float32
            )
        except ModelLoadError as err:
            raise ModelLoadError(f"--compare-draft {folder}: {err}") from err
    started = time.perf_counter()
    corpus = generate_data(config, args, spec)
    own, held = corpus.train, corpus.heldout
    generate_s = time.perf_counter() - started
    extra = (
        []
        if config.generate_only
        else load_data_from(config.data_from, spec.path, config.max_tokens)
    )
    train = Sequences.joined([own, *extra]) if extra else own
    if not len(train) and not config.generate_only:
        raise ValueError("no training conversation is left to train on")
    sources = {part.source: len(part.sequences) for part in corpus.parts}
    data = {
        "train_conversations": len(train),
        "template_conversations": config.num_prompts,
        "self_written_conversations": config.num_self_prompts,
        "self_written_other_language_share": config.self_other_languages,
        "followup_conversations": sources.get("follow-ups", 0),
        "train_answer_tokens": train.num_answer_tokens,
        "train_tokens": sum(len(t) for t in train.tokens),
        "heldout_conversations": len(held),
        "heldout_answer_tokens": held.num_answer_tokens,
    }
    if corpus.user_prompts:
        data["user_prompts"] = corpus.user_prompts
    if extra:
        data["data_from"] = [str(folder) for folder in config.data_from]
        data["data_from_conversations"] = len(train) - len(own)
    parts = corpus.parts + [CorpusPart("other folders", None, part) for part in extra]
    report = corpus_report(parts)
    if config.generate_only:
        summary = {
            "model": str(spec.path),
            "data": data,
            "corpus": report,
            "generate_s": round(generate_s, 1),
        }
        _write_summary(out, summary)
        return summary

    engine_config = dataclasses.replace(spec.engine_config, cpu_packed_linear=False)
    model_config = spec.model_config
    if config.aux_layers:
        outside = [i for i in config.aux_layers if not 0 <= i < model_config.num_layers]
        if outside or len(set(config.aux_layers)) != len(config.aux_layers):
            raise ValueError(
                f"aux_layers must be distinct layers of 0..{model_config.num_layers - 1}, "
                f"got {list(config.aux_layers)}"
            )
        model_config = dataclasses.replace(model_config, draft_aux_layers=config.aux_layers)
    target = build_model(model_config, engine_config, iter_safetensors(spec.path))
    device = torch.device(engine_config.device)
    rotary = RotaryEmbedding(
        spec.model_config.rope,
        spec.model_config.head_dim,
        max(config.schedule.max_seq_len, spec.model_config.max_position_embeddings),
        device,
    )
    torch.manual_seed(config.schedule.seed)
    # Float32 master weights; steps run in bf16 autocast on GPU.
    draft = MultiLayerEagleDraft(
        model_config, config.num_draft_steps, intermediate_size=config.draft_intermediate_size
    ).to(device)
    check_train_steps(
        config.steps_trained,
        config.num_draft_steps,
        config.num_draft_steps > 1 or model_config.spec_hidden_size == model_config.hidden_size,
    )
    with_train_steps(draft, config.steps_trained)
    run_key = {
        # By content: a checkpoint resumes after the folder moved or was converted again.
        "model": model_fingerprint(spec.path),
        "num_draft_steps": config.num_draft_steps,
        "intermediate_size": draft.intermediate_size,
        "aux_layers": list(config.aux_layers),
        "num_prompts": config.num_prompts,
        "num_self_prompts": config.num_self_prompts,
        "max_tokens": config.max_tokens,
    }
    if config.steps_trained != config.num_draft_steps:
        run_key["train_steps"] = config.steps_trained
    if corpus.user_prompts:
        run_key["user_turns"] = corpus.user_prompts["train_turns"]
    if extra:
        # Their sizes: a checkpoint resumes only over the same added data.
        run_key["data_from"] = [len(part) for part in extra]
    if config.restart:
        (out / CHECKPOINT_FILE).unlink(missing_ok=True)
    trainer = DraftTrainer(
        draft, target, rotary, train, held, config.schedule, out, run_key, config.progress
    )
    resumed = trainer.resume()
    progress = trainer.run()

    draft_dir = out / "draft"
    vocab, vocab_summary = _draft_vocab(config, model_config, train, held)
    if vocab is not None:
        # The replay of what is shipped: the engine proposes from the vocabulary only.
        draft.vocab = vocab.to(device)
        replay = trainer.validate()
        vocab_summary["replay"] = asdict(replay) if replay is not None else None
    saved = MultiLayerEagleDraft(
        model_config, config.num_draft_steps, vocab, config.draft_intermediate_size
    )
    saved.load_state_dict(stored_state(draft))
    save_draft(
        draft_dir,
        saved.to(SAVE_DTYPES[config.save_dtype]),
        spec.path.name,
        default_draft_steps=config.steps_trained,
    )
    summary = {
        "model": str(spec.path),
        "device": str(device),
        "config": {
            **{
                k: v
                for k, v in asdict(config).items()
                if k not in ("schedule", "out_dir", "data_from", "compare_drafts", "prompts_file")
            },
            "prompts_file": None if config.prompts_file is None else str(config.prompts_file),
            "data_from": [str(folder) for folder in config.data_from],
            "compare_drafts": [str(folder) for folder in config.compare_drafts],
            "schedule": asdict(config.schedule),
        },
        "data": data,
        "corpus": report,
        "generate_s": round(generate_s, 1),
        "train_s": round(progress.elapsed_s, 1),
        "steps": progress.step,
        "resumed": resumed,
        "final_train": _last_train_record(out),
        "validations": progress.validations,
        "draft_vocab": vocab_summary,
        "draft": str(draft_dir),
        "draft_bytes": (draft_dir / "model.safetensors").stat().st_size,
    }
    if config.evaluate:
        del trainer, target

        def heldout(draft: Path, chains: int = 1) -> dict:
            return evaluate_draft(
                config.model,
                draft,
                corpus.heldout_conversations,
                config.max_tokens,
                device=config.device,
                dtype=config.dtype,
                num_draft_chains=chains,
            )

        # The chain alone, then with alternative chains (`--num-draft-chains`).
        summary["engine_heldout"] = heldout(draft_dir)
        summary["engine_heldout_chains"] = heldout(draft_dir, HELDOUT_CHAINS)
        # Saved before the compared drafts run: the new draft's figures stay if one of them fails.
        _write_summary(out, summary)
        summary["engine_heldout_compared"] = [
            {"draft": str(folder), **heldout(folder)} for folder in config.compare_drafts
        ]
    _write_summary(out, summary)
    return summary


def _write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _draft_vocab(
    config: TrainDraftConfig, model_config: ModelConfig, train: Sequences, held: Sequences
) -> tuple[torch.Tensor | None, dict]:
    """The draft vocabulary: the most frequent answer tokens of the training data, with the
    target's end-of-turn tokens; and its size and coverage of training and held-out answers."""
    vocab_size = model_config.vocab_size
    if config.draft_vocab_size is None or config.draft_vocab_size >= vocab_size:
        return None, {"size": vocab_size, "restricted": False}
    train_counts = count_tokens(train.answers(), vocab_size)
    vocab = choose_draft_vocab(train_counts, config.draft_vocab_size, model_config.eos_token_ids)
    return vocab, {
        "size": vocab.numel(),
        "restricted": True,
        "train_answer_coverage": round(coverage(train_counts, vocab), 5),
        "heldout_answer_coverage": round(
            coverage(count_tokens(held.answers(), vocab_size), vocab), 5
        ),
    }


def _last_train_record(out: Path) -> dict | None:
    path = out / "train_log.jsonl"
    if not path.exists():
        return None
    last = None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            last = record
    return last
