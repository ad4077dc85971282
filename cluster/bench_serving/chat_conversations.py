"""Built-in chat conversations for the `chat` dataset: short multi-turn conversations about
varied topics, each ending with a user turn, with the length in tokens of the answer a real
assistant would give it (the request's max_tokens). User turns run from about 10 to 300 words,
as in real chat traffic: quick questions, follow-ups, and pasted code, notes or drafts.

The conversations are data: chat_conversations.jsonl beside this module (shipped with the
package, pyproject.toml package-data), one conversation a line, read and checked here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any


@dataclass(frozen=True)
class Conversation:
    topic: str
    turns: tuple[str, ...]  # user, assistant, user, ..., ending with the user turn to answer
    output_len: int  # tokens of the answer to the last turn


def _conversation(line: int, item: Any) -> Conversation:
    """Line `line`'s conversation; a malformed one raises naming its line."""
    fields = {"topic", "turns", "output_len"}
    if not isinstance(item, dict) or set(item) != fields:
        raise ValueError(f"chat_conversations.jsonl:{line}: expected the fields {sorted(fields)}")
    topic, turns, output_len = item["topic"], item["turns"], item["output_len"]
    ok = isinstance(topic, str) and isinstance(turns, list) and len(turns) % 2 == 1
    ok = ok and all(isinstance(turn, str) for turn in turns)
    if not ok or not isinstance(output_len, int) or output_len <= 0:
        raise ValueError(
            f"chat_conversations.jsonl:{line}: a topic, an odd number of turns (ending with "
            "the user's) and a positive output_len"
        )
    return Conversation(topic, tuple(turns), output_len)


def load_conversations() -> tuple[Conversation, ...]:
    text = files("cluster.bench_serving").joinpath("chat_conversations.jsonl").read_text("utf-8")
    return tuple(
        _conversation(line, json.loads(raw))
        for line, raw in enumerate(text.splitlines(), start=1)
        if raw.strip()
    )


CONVERSATIONS: tuple[Conversation, ...] = load_conversations()
