"""The training data: the target's own greedy answers to a prompt set, generated with the
project's engine, kept as token sequences (prompt + answer) in one file that grows chunk by
chunk, so an interrupted generation resumes where it stopped."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.loading.weights import model_fingerprint


@dataclass
class Sequences:
    """Token sequences, each a prompt followed by the target's greedy answer (EOS included when
    the answer ended on it). `meta` says how they were made; a resumed run must match it."""

    tokens: list[list[int]] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_answer_tokens(self) -> int:
        return sum(len(t) - n for t, n in zip(self.tokens, self.prompt_lens))

    def answers(self) -> list[list[int]]:
        """Each sequence's answer tokens."""
        return [t[n:] for t, n in zip(self.tokens, self.prompt_lens)]

    @classmethod
    def joined(cls, parts: list[Sequences]) -> Sequences:
        """One set of every part's sequences, in order; `meta` lists the parts'."""
        joined = cls(meta={"parts": [part.meta for part in parts]})
        for part in parts:
            joined.tokens += part.tokens
            joined.prompt_lens += part.prompt_lens
        return joined

    def save(self, path: Path) -> None:
        # Written aside, then renamed: a run killed mid-write leaves the previous file whole.
        partial = path.with_name(path.name + ".partial")
        torch.save(
            {"tokens": self.tokens, "prompt_lens": self.prompt_lens, "meta": self.meta}, partial
        )
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> Sequences:
        raw = torch.load(path, weights_only=True)
        return cls(raw["tokens"], raw["prompt_lens"], raw["meta"])


def model_meta(model_path: str | os.PathLike) -> dict[str, str]:
    """How a generated file names the model that made it: its folder, and a digest of its
    content that survives moving the folder or converting the same GGUF file again."""
    return {"model": str(model_path), "model_fingerprint": model_fingerprint(Path(model_path))}


_MODEL_KEYS = ("model", "model_fingerprint")


def differing_settings(
    stored: dict[str, Any], wanted: dict[str, Any], keys: Iterable[str]
) -> list[str]:
    """Which of `keys` a generated file's `stored` meta has otherwise than `wanted`. The model
    is compared by digest, or by folder for a file written before files carried one, and is
    reported as "model"."""
    differ = sorted(k for k in set(keys) - set(_MODEL_KEYS) if stored.get(k) != wanted.get(k))
    if "model_fingerprint" in stored and "model_fingerprint" in wanted:
        same_model = stored["model_fingerprint"] == wanted["model_fingerprint"]
    else:
        same_model = stored.get("model") == wanted.get("model")
    return differ if same_model else ["model", *differ]


def progress_interval() -> float:
    """Seconds between progress-bar updates: a log file gets a line now and then, not every
    redraw a terminal would show."""
    return 0.1 if sys.stderr.isatty() else 30.0


def target_answers(
    llm: LLM,
    conversations: list[list[dict[str, str]]],
    path: Path,
    max_tokens: int,
    chunk: int = 256,
    progress: bool = True,
    save_every_s: float = 60.0,
) -> Sequences:
    """The target's greedy answer to every conversation, in `path`. An existing file made with
    the same settings is extended from where it stopped; one made otherwise is refused.

    The file is rewritten whole, so it is saved after a chunk only once `save_every_s` have
    passed since the last save (and always at the end): rewriting it after every chunk cost
    a growing share of a long run."""
    meta = {
        **model_meta(llm.model_path),
        "max_tokens": max_tokens,
        "num_conversations": len(conversations),
        "first": conversations[0] if conversations else None,
    }
    data = Sequences(meta=meta)
    if path.exists():
        data = Sequences.load(path)
        # More conversations may be asked for than a file holds: a prompt set is built so that
        # a longer list starts with the shorter one, and the file is extended.
        growing = ("num_conversations",)
        differ = differing_settings(data.meta, meta, (k for k in meta if k not in growing))
        if len(data) > len(conversations):
            differ.append("num_conversations")
        if differ:
            raise ValueError(
                f"{path} was generated with other settings ({', '.join(differ)}); "
                "remove it or use another output folder"
            )
        data.meta = meta
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(conversations),
        initial=len(data),
        desc=f"answers -> {path.name}",
        unit="conv",
        disable=not progress,
        mininterval=progress_interval(),
    )
    saved_at = time.monotonic()
    with bar:
        for start in range(len(data), len(conversations), chunk):
            batch = conversations[start : start + chunk]
            for out in llm.chat(batch, params):
                data.tokens.append(list(out.prompt_token_ids) + list(out.token_ids))
                data.prompt_lens.append(len(out.prompt_token_ids))
            last = start + chunk >= len(conversations)
            if last or time.monotonic() - saved_at >= save_every_s:
                data.save(path)
                saved_at = time.monotonic()
            bar.update(len(batch))
            bar.set_postfix(answer_tokens=data.num_answer_tokens)
    return data
