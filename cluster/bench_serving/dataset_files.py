"""Prompts read from a file: ShareGPT JSON or JSONL. Only parsing here; lengths are measured
later, on the prompts a run draws, so a large ShareGPT dump is never tokenized whole.

- ShareGPT: a JSON list of {"conversations": [{"from": "human" | "gpt", "value": ...}, ...]}.
  The prompt is the first human turn; the gpt turn after it is the reference answer, whose
  length in tokens becomes the request's output length. Entries without such a pair are skipped.
- JSONL: one {"prompt": ..., "output_len" | "max_tokens": N (optional)} object per line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUMAN_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt")


class DatasetFileError(ValueError):
    """A prompt file that cannot be used, with the reason and where."""


@dataclass(frozen=True)
class FilePrompt:
    prompt: str
    output_len: int | None = None  # given by the file
    reference_output: str | None = None  # an answer whose length sets the output length


def read_prompt_file(path: str | Path) -> list[FilePrompt]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise DatasetFileError(f"cannot read the dataset file {path}: {err}") from err
    is_sharegpt = text.lstrip().startswith("[")
    prompts = _read_sharegpt(text, path) if is_sharegpt else _read_jsonl(text, path)
    if not prompts:
        raise DatasetFileError(f"the dataset file {path} holds no usable prompt")
    return prompts


def _read_sharegpt(text: str, path: Path) -> list[FilePrompt]:
    try:
        entries = json.loads(text)
    except ValueError as err:
        raise DatasetFileError(f"{path} is not valid JSON: {err}") from err
    prompts = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        pair = _first_exchange(turns) if isinstance(turns, list) else None
        if pair is not None:
            prompts.append(FilePrompt(prompt=pair[0], reference_output=pair[1]))
    return prompts


def _first_exchange(turns: list[Any]) -> tuple[str, str] | None:
    """(first human turn, the assistant turn right after it), both non-empty, or None."""
    for turn, reply in zip(turns, turns[1:]):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") in HUMAN_ROLES:
            question, answer = turn.get("value"), reply.get("value")
            is_answer = reply.get("from") in ASSISTANT_ROLES
            if is_answer and _is_text(question) and _is_text(answer):
                return question, answer
            return None
    return None


def _read_jsonl(text: str, path: Path) -> list[FilePrompt]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DatasetFileError(f"{where}: not a JSON object: {err}") from err
        if not isinstance(record, dict) or not _is_text(record.get("prompt")):
            raise DatasetFileError(f'{where}: expected {{"prompt": "<non-empty text>", ...}}')
        prompts.append(FilePrompt(record["prompt"], _output_len(record, where)))
    return prompts


def _output_len(record: dict[str, Any], where: str) -> int | None:
    value = record.get("output_len", record.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DatasetFileError(f"{where}: the output length must be a positive integer: {value!r}")
    return value


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())
