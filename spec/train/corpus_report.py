"""The training corpus's size and mix, for summary.json and the command's output: conversations
and tokens by source, how diverse the requests are, and what they ask for.

- Diversity: distinct-n, the number of distinct word n-grams over the number of n-grams (n = 2,
  3), over the last user message of every conversation (the one the target answers). 1 means no
  n-gram repeats; templates filled from a few patterns score low.
- Formats: each last user message gets the first format whose rule matches (FORMAT_RULES: code,
  math, translation, summary, list, writing), else "question" when it ends with "?", else
  "other". The rules are English keywords: a message in another language mostly counts as
  "question" or "other".
- Shapes: the share of conversations with more than one user message, with a system prompt, and
  whose last user message has a letter outside ASCII (other languages, mostly)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spec.train.data import Sequences
from spec.train.prompts import Conversation

FORMAT_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "code",
        re.compile(
            r"```|\bdef |\bfunction\b|\bcode\b|\bpython\b|\bjavascript\b|\bsql\b|\bregex\b|"
            r"regular expression|\bc\+\+|\bjava\b|\brust\b|\bbash\b|\bhtml\b|\bprogram\b",
            re.IGNORECASE,
        ),
    ),
    (
        "math",
        re.compile(
            r"\d\s*[-+*/^×÷=]\s*\d|\bcalculate\b|\bsolve\b|\bequation\b|\bhow (many|much)\b|"
            r"\bpercent",
            re.IGNORECASE,
        ),
    ),
    ("translation", re.compile(r"\btranslat", re.IGNORECASE)),
    ("summary", re.compile(r"\bsummar|\btl;?dr\b", re.IGNORECASE)),
    (
        "list",
        re.compile(
            r"\blist\b|\btips\b|\bsteps\b|\bways to\b|\bideas\b|\b\d+ (things|ways|reasons|"
            r"tips|ideas|examples|names)\b",
            re.IGNORECASE,
        ),
    ),
    (
        "writing",
        re.compile(
            r"\bwrite\b|\bpoem\b|\bstory\b|\bhaiku\b|\blimerick\b|\bletter\b|\bessay\b|"
            r"\bdraft\b|\bspeech\b|\brewrite\b|\brephrase\b",
            re.IGNORECASE,
        ),
    ),
)
FORMATS = tuple(name for name, _ in FORMAT_RULES) + ("question", "other")
_WORD = re.compile(r"\w+")


@dataclass
class CorpusPart:
    """One source of the corpus: its conversations (None where only the answers are known, as
    for another folder's data) and the target's answers to them."""

    source: str
    conversations: list[Conversation] | None
    sequences: Sequences


def request_format(message: str) -> str:
    for name, rule in FORMAT_RULES:
        if rule.search(message):
            return name
    return "question" if message.rstrip().endswith("?") else "other"


def distinct_ngrams(texts: list[str], n: int) -> float:
    """Distinct word n-grams over all word n-grams of `texts` (0 when there are none)."""
    seen: set[tuple[str, ...]] = set()
    total = 0
    for text in texts:
        words = _WORD.findall(text.casefold())
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        total += len(grams)
        seen.update(grams)
    return len(seen) / total if total else 0.0


def corpus_report(parts: list[CorpusPart]) -> dict:
    """The corpus's size by source and, over the parts whose conversations are known, its
    diversity, formats and shapes."""
    sources: dict[str, dict[str, int]] = {}
    for part in parts:
        entry = sources.setdefault(
            part.source, {"conversations": 0, "prompt_tokens": 0, "answer_tokens": 0}
        )
        entry["conversations"] += len(part.sequences)
        entry["prompt_tokens"] += sum(part.sequences.prompt_lens)
        entry["answer_tokens"] += part.sequences.num_answer_tokens
    total = {key: sum(entry[key] for entry in sources.values()) for key in _TOTALS}
    conversations = [c for part in parts if part.conversations for c in part.conversations]
    last = [[m for m in c if m["role"] == "user"][-1]["content"] for c in conversations]
    counted = len(last) or 1
    formats = {name: 0 for name in FORMATS}
    for message in last:
        formats[request_format(message)] += 1
    return {
        "sources": sources,
        "total": total,
        "described_conversations": len(conversations),
        "distinct_user_messages": len(set(last)),
        "distinct_2gram_ratio": round(distinct_ngrams(last, 2), 4),
        "distinct_3gram_ratio": round(distinct_ngrams(last, 3), 4),
        "format_shares": {name: round(count / counted, 4) for name, count in formats.items()},
        "multi_turn_share": round(
            sum(sum(m["role"] == "user" for m in c) > 1 for c in conversations) / counted, 4
        ),
        "system_prompt_share": round(
            sum(any(m["role"] == "system" for m in c) for c in conversations) / counted, 4
        ),
        "non_ascii_share": round(
            sum(any(ch.isalpha() and not ch.isascii() for ch in m) for m in last) / counted, 4
        ),
    }


_TOTALS = ("conversations", "prompt_tokens", "answer_tokens")


def report_lines(report: dict) -> list[str]:
    """The report as the command prints it."""
    lines = [
        f"corpus: {report['total']['conversations']} conversations, "
        f"{report['total']['answer_tokens']} answer tokens, "
        f"{report['total']['prompt_tokens']} prompt tokens"
    ]
    for source, entry in report["sources"].items():
        lines.append(
            f"  {source}: {entry['conversations']} conversations, "
            f"{entry['answer_tokens']} answer tokens"
        )
    shares = ", ".join(
        f"{name} {share:.0%}" for name, share in report["format_shares"].items() if share
    )
    lines.append(
        f"  requests: distinct 2-grams {report['distinct_2gram_ratio']:.2f}, 3-grams "
        f"{report['distinct_3gram_ratio']:.2f}; multi-turn {report['multi_turn_share']:.0%}, "
        f"system prompt {report['system_prompt_share']:.0%}, non-ASCII "
        f"{report['non_ascii_share']:.0%}; {shares}"
    )
    return lines
