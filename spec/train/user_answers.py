"""The target's answers to a user's prompts (`--prompts FILE`): the file read
(spec.train.user_prompts), repeats dropped and a held-out share set apart
(spec.train.user_split), then every conversation answered turn by turn. Turn t of every
conversation is asked in one round, after the target's own answers to its turns before t, so
the whole conversation is the target's; each round's answers are trained on (or held out).

The kept conversations are recorded in `user_prompts.json`: a run over the same folder with
another file, seed or held-out share, whose answer files would no longer match, is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine import LLM
from spec.train.corpus_report import CorpusPart
from spec.train.data import Sequences
from spec.train.prompts import Conversation, heldout_prompts
from spec.train.user_prompts import UserConversation, read_prompt_file
from spec.train.user_split import split_user_prompts

if TYPE_CHECKING:
    from spec.train.run_config import TrainDraftConfig

RECORD_FILE = "user_prompts.json"
SOURCE = "user file"

Answers = Callable[[list[Conversation], str], Sequences]


@dataclass
class UserData:
    train: list[CorpusPart]  # one part per round
    heldout: list[Sequences]  # one per round
    heldout_conversations: list[Conversation]  # what `heldout` answers, in its order
    counts: dict


def user_prompt_data(
    config: TrainDraftConfig,
    llm: LLM,
    answers: Answers,
    known_messages: list[str],
    fits: Callable[[Conversation], bool],
) -> UserData:
    """`answers(conversations, file)`: the target's answers, kept in `file` of the run's folder;
    `known_messages`: the template and self-written user messages; `fits`: whether a
    conversation's prompt leaves the engine room for an answer (a turn that does not, and the
    turns after it, are not asked)."""
    if config.prompts_file is None:
        raise ValueError("user_prompt_data needs a prompts file")
    read = read_prompt_file(config.prompts_file)
    builtin = [m["content"] for c in heldout_prompts() for m in c if m["role"] == "user"]
    split = split_user_prompts(
        read.conversations,
        known_messages,
        builtin,
        config.prompts_heldout_share,
        config.schedule.seed,
    )
    _check_record(config.out_dir / RECORD_FILE, config.prompts_file, split.train, split.heldout)

    def decode(answer: list[int]) -> str:
        return llm.tokenizer.decode(answer, skip_special_tokens=True).strip()

    train_rounds, train_asked, train_cut = answer_by_turns(
        split.train, answers, decode, fits, config.prompts_max_turns, "user_answers"
    )
    held_rounds, held_asked, held_cut = answer_by_turns(
        split.heldout, answers, decode, fits, config.prompts_max_turns, "user_heldout"
    )
    return UserData(
        train=[CorpusPart(SOURCE, asked, seqs) for asked, seqs in zip(train_asked, train_rounds)],
        heldout=held_rounds,
        heldout_conversations=[c for asked in held_asked for c in asked],
        counts={
            "file": str(config.prompts_file),
            "read": len(read.conversations) + read.skipped,
            "without_user_message": read.skipped,
            "repeats": split.repeats,
            "sharing_builtin_heldout": split.heldout_overlap,
            "train_conversations": len(split.train),
            "heldout_conversations": len(split.heldout),
            "train_turns": sum(len(asked) for asked in train_asked),
            "heldout_turns": sum(len(asked) for asked in held_asked),
            "turns_too_long": train_cut + held_cut,
        },
    )


def answer_by_turns(
    conversations: list[UserConversation],
    answers: Answers,
    decode: Callable[[list[int]], str],
    fits: Callable[[Conversation], bool],
    max_turns: int,
    prefix: str,
) -> tuple[list[Sequences], list[list[Conversation]], int]:
    """Each round's answers and the conversations it asked (round t in `{prefix}.pt`, then
    `{prefix}_t.pt`), and the number of turns left unasked because their prompt did not fit."""
    heads: list[Conversation] = [
        [{"role": "system", "content": c.system}] if c.system else [] for c in conversations
    ]
    active = list(range(len(conversations)))
    rounds: list[Sequences] = []
    asked_by_round: list[list[Conversation]] = []
    cut = 0
    for turn in range(max_turns):
        asked, who = [], []
        for i in active:
            if len(conversations[i].user_turns) <= turn:
                continue
            conversation = [
                *heads[i],
                {"role": "user", "content": conversations[i].user_turns[turn]},
            ]
            if fits(conversation):
                asked.append(conversation)
                who.append(i)
            else:
                cut += len(conversations[i].user_turns[turn:max_turns])
        if not asked:
            break
        answered = answers(asked, f"{prefix}.pt" if turn == 0 else f"{prefix}_{turn + 1}.pt")
        for i, conversation, answer in zip(who, asked, answered.answers(), strict=True):
            heads[i] = [*conversation, {"role": "assistant", "content": decode(answer)}]
        rounds.append(answered)
        asked_by_round.append(asked)
        active = who
    return rounds, asked_by_round, cut


def _check_record(
    path: Path, file: Path, train: list[UserConversation], heldout: list[UserConversation]
) -> None:
    def listed(conversations: list[UserConversation]) -> list[dict]:
        return [asdict(c) | {"user_turns": list(c.user_turns)} for c in conversations]

    record = {"file": str(file), "train": listed(train), "heldout": listed(heldout)}
    if path.exists():
        stored = json.loads(path.read_text())
        if {k: stored.get(k) for k in ("train", "heldout")} != {
            k: record[k] for k in ("train", "heldout")
        }:
            raise ValueError(
                f"{path} lists other user conversations than {file} gives now (another file, "
                "seed, held-out share, or other template or self-written prompts): use another "
                "output folder, or remove it and the user_answers*.pt and user_heldout*.pt files"
            )
    path.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
