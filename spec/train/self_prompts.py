"""User messages written by the target itself: the chat template up to where a user's message
starts, continued by the model at temperature 1 until it ends the turn. An instruction-tuned
model has seen many user turns, so what it writes there reads like the questions it is asked:
far more varied than any written template set, and from the distribution it answers best.

Some continuations start from a short opening word ("Write", "How", ...) to spread them over
kinds of request; the rest are left wholly to the model. Every candidate has its own seed, so
the set does not depend on batching, and it grows in order: a longer set begins with a shorter
one, and an interrupted run resumes from the file it keeps."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from spec.train.data import differing_settings, model_meta, progress_interval
from spec.train.prompts import Conversation

# "" leaves the whole message to the model; it is listed several times to weigh it.
OPENINGS = (
    "", "", "", "", "", "",
    "What", "How", "Why", "Which", "Is it", "Can you", "Could you", "Please",
    "Write", "Explain", "Describe", "Summarize", "List", "Give me", "Tell me", "Suggest",
    "Compare", "Translate", "Create", "Help me", "I", "I'm", "My", "Rewrite", "Plan",
    "Solve", "Calculate", "Define", "Draft", "Make",
)  # fmt: skip

# Openings in other languages, for a share of the messages (`other_languages`): left alone, a
# model writes almost every user message in English.
OTHER_LANGUAGE_OPENINGS = (
    "Écris", "Explique", "Pourquoi", "Comment", "Quelle", "Peux-tu",
    "Escribe", "Explica", "¿Por qué", "¿Cómo", "¿Qué", "¿Puedes",
    "Schreibe", "Erkläre", "Warum", "Wie", "Was ist", "Kannst du",
    "Scrivi", "Spiega", "Perché", "Come", "Escreva", "Por que",
)  # fmt: skip

_SENTINEL = "\u2063SENTINEL\u2063"


@dataclass(frozen=True)
class UserTurn:
    """The template's text before a user message (system prompt included), and the marker that
    ends one."""

    prefix: str
    end: str


def user_turn(tokenizer: Any) -> UserTurn:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not show a user message once")
    prefix, suffix = text.split(_SENTINEL)
    # "<|im_end|>\n" ends a turn with a marker; a template that ends it with a line break alone
    # leaves the line break.
    end = suffix.strip() or suffix[:1]
    if not end:
        raise ValueError("the chat template marks no end of a user message")
    return UserTurn(prefix, end)


@dataclass
class _Store:
    prompts: list[Any]  # messages, or whole conversations (follow-ups)
    tried: int
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: Path, meta: dict[str, Any]) -> _Store:
        """The store kept in `path`, refused if made with other settings; else an empty one."""
        if not path.exists():
            return cls([], 0, meta)
        raw = json.loads(path.read_text())
        _check_settings(path, raw["meta"], meta)
        return cls(raw["prompts"], raw["tried"], meta)

    def progress_bar(self, n: int, desc: str, progress: bool):
        from tqdm.auto import tqdm

        return tqdm(
            total=n,
            initial=min(n, len(self.prompts)),
            desc=desc,
            unit="msg",
            disable=not progress,
            mininterval=progress_interval(),
        )

    def save(self, path: Path) -> None:
        partial = path.with_name(path.name + ".partial")
        partial.write_text(
            json.dumps({"meta": self.meta, "tried": self.tried, "prompts": self.prompts})
        )
        os.replace(partial, path)


def _candidate_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % 2**63


def self_written_prompts(
    llm: LLM,
    n: int,
    path: Path,
    seed: int = 0,
    max_tokens: int = 96,
    chunk: int = 512,
    progress: bool = True,
    other_languages: float = 0.0,
) -> list[Conversation]:
    """`n` distinct single-turn conversations whose user message the model in `llm` wrote,
    kept in `path` (JSON) as they are made. `other_languages`: the share of candidates that
    start from an opening in another language than English."""
    if not 0.0 <= other_languages <= 1.0:
        raise ValueError(f"other_languages is a share in [0, 1], got {other_languages}")
    turn = user_turn(llm.tokenizer)
    meta = {**model_meta(llm.model_path), "seed": seed, "max_tokens": max_tokens, "turn": turn.end}
    if other_languages:
        meta["other_languages"] = other_languages  # absent at 0: earlier files stay valid
    store = _Store.open(path, meta)
    seen = {_key(p) for p in store.prompts}
    prefix_ids = llm.tokenizer.encode(turn.prefix, add_special_tokens=False)
    bar = store.progress_bar(n, f"user messages -> {path.name}", progress)
    # A model that rarely writes a usable message must not loop for ever.
    give_up = 20 * n + 10 * chunk
    with bar:
        while len(store.prompts) < n:
            if store.tried >= give_up:
                raise RuntimeError(
                    f"the model wrote {len(store.prompts)} distinct user messages in "
                    f"{store.tried} tries; {n} were asked for"
                )
            first = store.tried
            openings, prompts, params = [], [], []
            for index in range(first, first + chunk):
                candidate_seed = _candidate_seed(seed, index)
                opening = _opening(random.Random(candidate_seed), other_languages)
                openings.append(opening)
                prompts.append(prefix_ids + llm.tokenizer.encode(opening, add_special_tokens=False))
                params.append(_sampling(max_tokens, candidate_seed, turn))
            before = len(store.prompts)
            for opening, out in zip(openings, llm.generate(prompts, params)):
                message = _clean(opening, out.text, turn)
                if message is None or _key(message) in seen or len(store.prompts) >= n:
                    continue
                seen.add(_key(message))
                store.prompts.append(message)
            store.tried = first + chunk
            store.save(path)
            bar.update(len(store.prompts) - before)
    return [[{"role": "user", "content": p}] for p in store.prompts[:n]]


def _check_settings(path: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    # Every key of either side: one a file has and the call does not is a difference too.
    differ = differing_settings(stored, wanted, stored.keys() | wanted.keys())
    if differ:
        raise ValueError(
            f"{path} was written with other settings ({', '.join(differ)}); "
            "remove it or use another output folder"
        )


def _sampling(max_tokens: int, candidate_seed: int, turn: UserTurn) -> SamplingParams:
    """How a user message is written: sampled, with the candidate's own seed, to the turn's end."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=candidate_seed, stop=turn.end
    )


def _opening(rng: random.Random, other_languages: float) -> str:
    # Without other languages, one draw: the same openings as before the option existed.
    if other_languages and rng.random() < other_languages:
        return rng.choice(OTHER_LANGUAGE_OPENINGS)
    return rng.choice(OPENINGS)


def self_written_followups(
    llm: LLM,
    conversations: list[Conversation],
    answers: list[str],
    n: int,
    path: Path,
    seed: int = 0,
    max_tokens: int = 96,
    chunk: int = 512,
    progress: bool = True,
) -> list[Conversation]:
    """Up to `n` three-turn conversations: one of `conversations`, the target's `answers` to
    it, and a second user message the model in `llm` wrote after them (sampled like
    `self_written_prompts`, one try per conversation, in order), kept in `path` (JSON). Fewer
    come back when the conversations run out."""
    if len(answers) != len(conversations):
        raise ValueError(f"{len(answers)} answers for {len(conversations)} conversations")
    turn = user_turn(llm.tokenizer)
    meta = {
        **model_meta(llm.model_path),
        "seed": seed,
        "max_tokens": max_tokens,
        "turn": turn.end,
        "first": conversations[0] if conversations else None,
    }
    store = _Store.open(path, meta)
    bar = store.progress_bar(n, f"follow-up messages -> {path.name}", progress)
    with bar:
        while len(store.prompts) < n and store.tried < len(conversations):
            first = store.tried
            heads, prompts, params = [], [], []
            for index in range(first, min(first + chunk, len(conversations))):
                candidate_seed = _candidate_seed(seed + 1, index)
                opening = _opening(random.Random(candidate_seed), 0.0)
                head = [*conversations[index], {"role": "assistant", "content": answers[index]}]
                # The template's own text up to where the next user message starts.
                text = llm.tokenizer.apply_chat_template(
                    [*head, {"role": "user", "content": _SENTINEL}],
                    tokenize=False,
                    add_generation_prompt=False,
                )
                before = text[: text.index(_SENTINEL)] + opening
                heads.append((head, opening))
                prompts.append(llm.tokenizer.encode(before, add_special_tokens=False))
                params.append(_sampling(max_tokens, candidate_seed, turn))
            written_before = len(store.prompts)
            for (head, opening), out in zip(heads, llm.generate(prompts, params)):
                message = _clean(opening, out.text, turn)
                if message is not None and len(store.prompts) < n:
                    store.prompts.append([*head, {"role": "user", "content": message}])
            store.tried = first + len(prompts)
            store.save(path)
            bar.update(len(store.prompts) - written_before)
    return store.prompts[:n]


def _clean(opening: str, written: str, turn: UserTurn) -> str | None:
    written = written.split(turn.end)[0]
    # A message that opens another turn, or where the model added next to nothing to the
    # opening, is no question.
    marker = turn.prefix.strip()[:8]
    if len(written.strip()) < 8 or (marker and marker in written):
        return None
    return (opening + written).strip()


def _key(message: str) -> str:
    return " ".join(message.lower().split())
