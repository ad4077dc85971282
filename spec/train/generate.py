"""The data a draft trains on, made by its target with the project's own engine: answers to the
written templates, to messages the target writes itself and to their follow-ups, to a user's
prompts (spec.train.user_answers), and to the held-out prompts (never trained on); and the
answer files of other runs' folders (`data_from`). Every file resumes where a stopped run saved
it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine import LLM
from engine.loading.loader import EngineArgs, ModelSpec
from spec.train.corpus_report import CorpusPart
from spec.train.data import Sequences, differing_settings, model_meta, target_answers
from spec.train.prompts import Conversation, heldout_prompts, training_prompts
from spec.train.self_prompts import self_written_followups, self_written_prompts
from spec.train.user_answers import user_prompt_data

if TYPE_CHECKING:
    from spec.train.run_config import TrainDraftConfig

# The training answers a run generates (heldout.pt is never trained on).
ANSWER_FILES = ("answers.pt", "self_answers.pt", "followup_answers.pt")


@dataclass
class Corpus:
    """A run's own data: the training parts by source, the held-out answers and the
    conversations they answer (the built-in held-out set's, then the user's held-out ones)."""

    parts: list[CorpusPart]
    heldout: Sequences
    heldout_conversations: list[Conversation]
    user_prompts: dict = field(default_factory=dict)  # what became of a user's prompt file

    @property
    def train(self) -> Sequences:
        return Sequences.joined([part.sequences for part in self.parts])


def generate_data(config: TrainDraftConfig, args: EngineArgs, spec: ModelSpec) -> Corpus:
    """The training answers (templates, self-written messages, their follow-ups, a user's
    prompts) and the held-out answers, each made by the target or read back where an earlier run
    saved them."""
    conversations = training_prompts(config.num_prompts, config.schedule.seed)
    heldout = heldout_prompts()[: config.num_heldout]
    # Room for every sequence of a full batch: the answers, and prompts of a few hundred tokens;
    # a follow-up's prompt also holds a first message and its whole answer.
    prompt_room = 1024 + (
        config.max_tokens + config.self_prompt_max_tokens if config.num_self_followups else 0
    )
    kv_tokens = config.generate_batch * (config.max_tokens + prompt_room // 2)
    max_model_len = min(spec.engine_config.max_model_len, config.max_tokens + prompt_room)
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=config.generate_batch,
        max_model_len=max_model_len,
        kv_cache_tokens=kv_tokens,
        seed=config.schedule.seed,
    )

    def answers(conversations: list[Conversation], file: str) -> Sequences:
        return target_answers(
            llm,
            conversations,
            config.out_dir / file,
            config.max_tokens,
            chunk=config.generate_batch,
            progress=config.progress,
        )

    # How the target writes user messages, for the self-written ones and their follow-ups.
    writing = dict(
        seed=config.schedule.seed,
        max_tokens=config.self_prompt_max_tokens,
        chunk=config.generate_batch,
        progress=config.progress,
    )
    parts = []
    written: list[Conversation] = []
    if conversations:
        parts.append(CorpusPart("templates", conversations, answers(conversations, "answers.pt")))
    if config.num_self_prompts:
        written = self_written_prompts(
            llm,
            config.num_self_prompts,
            config.out_dir / "self_prompts.json",
            other_languages=config.self_other_languages,
            **writing,
        )
        answered = answers(written, "self_answers.pt")
        parts.append(CorpusPart("self-written", written, answered))
        if config.num_self_followups:
            texts = [
                llm.tokenizer.decode(answer, skip_special_tokens=True).strip()
                for answer in answered.answers()
            ]
            followups = self_written_followups(
                llm,
                written,
                texts,
                config.num_self_followups,
                config.out_dir / "self_followups.json",
                **writing,
            )
            parts.append(
                CorpusPart("follow-ups", followups, answers(followups, "followup_answers.pt"))
            )
    held = answers(heldout, "heldout.pt")
    if config.prompts_file is None:
        return Corpus(parts, held, heldout)
    known = [m["content"] for c in conversations + written for m in c if m["role"] == "user"]
    user = user_prompt_data(
        config,
        llm,
        answers,
        known,
        fits=lambda c: len(llm.apply_chat_template(c)) + config.max_tokens <= max_model_len,
    )
    joined = Sequences.joined([held, *user.heldout])
    # What the replay reads as the answers' length cap.
    joined.meta["max_tokens"] = config.max_tokens
    return Corpus(parts + user.train, joined, heldout + user.heldout_conversations, user.counts)


def load_data_from(folders: tuple[Path, ...], model_path: Path, max_tokens: int) -> list[Sequences]:
    """The answer files of `folders`, refused unless the same target made them with the same
    answer length cap. A folder's generation may have stopped half way: what it holds counts."""
    wanted = {**model_meta(model_path), "max_tokens": max_tokens}
    parts = []
    for folder in folders:
        found = [folder / name for name in ANSWER_FILES if (folder / name).exists()]
        if not found:
            raise ValueError(f"{folder} holds none of {', '.join(ANSWER_FILES)}")
        for path in found:
            part = Sequences.load(path)
            differ = differing_settings(part.meta, wanted, ("max_tokens",))
            if differ:
                raise ValueError(
                    f"{path} was generated with other settings than this run ({', '.join(differ)})"
                )
            parts.append(part)
    return parts
