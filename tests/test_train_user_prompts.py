"""A user's prompts for `train-draft --prompts FILE` (spec/train/user_prompts.py,
user_split.py, user_answers.py) and the corpus report (spec/train/corpus_report.py): both file
formats are read, a malformed file is refused with its path and line, repeats are dropped,
the held-out share shares no conversation and no user message with training, the target answers
every turn, and the report counts what the corpus holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cluster.commands.cli import main
from spec.train.corpus_report import (
    CorpusPart,
    corpus_report,
    distinct_ngrams,
    report_lines,
    request_format,
)
from spec.train.data import Sequences
from spec.train.prompts import heldout_prompts, training_prompts
from spec.train.user_answers import answer_by_turns
from spec.train.user_prompts import (
    PromptFileError,
    UserConversation,
    normalised,
    read_prompt_file,
)
from spec.train.user_split import split_user_prompts, user_message_keys

# One CPU thread, and the predictable target: conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


def sharegpt(*conversations: list[tuple[str, str]]) -> str:
    items = [{"conversations": [{"from": f, "value": v} for f, v in c]} for c in conversations]
    return json.dumps(items, indent=1)


def test_sharegpt_keeps_the_user_turns_under_the_system_prompt(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(
        sharegpt(
            [
                ("system", "Be brief."),
                ("human", " Hi there "),
                ("gpt", "Hello!"),
                ("human", "Why?"),
            ],
            [("human", "Only one")],
            [("gpt", "I speak first"), ("human", "   ")],  # no user message left: skipped
        )
    )
    read = read_prompt_file(path)
    assert read.skipped == 1
    first, second = read.conversations
    assert (first.system, first.user_turns) == ("Be brief.", ("Hi there", "Why?"))
    assert (second.system, second.user_turns) == (None, ("Only one",))
    assert (first.line, second.line) == (2, 22)
    assert path.read_text().splitlines()[21].strip() == "{"


def test_jsonl_reads_messages_and_prompts(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "A"}]},
        {"prompt": "B"},
        {"messages": [{"role": "user", "content": "C"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "D"}]},
    ]  # fmt: skip
    path.write_text(
        "\n".join(json.dumps(line) for line in lines[:2]) + "\n\n" + json.dumps(lines[2])
    )
    read = read_prompt_file(path)
    assert [(c.system, c.user_turns, c.line) for c in read.conversations] == [
        ("S", ("A",), 1),
        (None, ("B",), 2),
        (None, ("C", "D"), 4),
    ]


@pytest.mark.parametrize(
    "name, text, where, reason",
    [
        ("a.jsonl", '{"prompt": "ok"}\n{"prompt": "ok"\n', ":2:", "not a JSON object"),
        ("b.jsonl", '{"prompt": "ok"}\n[1, 2]\n', ":2:", "'messages' list or a 'prompt'"),
        ("c.jsonl", '{"messages": [{"role": "bot", "content": "x"}]}', ":1:", "role 'bot'"),
        ("d.jsonl", '{"prompt": 3}', ":1:", "'prompt' must be text"),
        ("e.json", '[\n {"conversations": []},\n {"conversations": [{"from": "bing", '
         '"value": "x"}]}\n]', ":3:", "from 'bing'"),
        ("f.json", '[\n {"conversations": [{"from": "human", "value": "x"}]},\n {"oops": 1}\n]',
         ":3:", "'conversations' list"),
        ("g.json", '[\n {"conversations": []}\n', ":3:", "not closed"),
        ("h.json", '[\n {"conversations": []}\n {"conversations": []}]', ":3:", "expected ','"),
        ("i.json", '[\n {"conversations": [}\n]', ":2:", "Expecting value"),
        ("j.json", '[{"conversations": [{"from": "human", "value": "u"}, '
         '{"from": "system", "value": "s"}]}]', ":1:", "system message after a user message"),
        ("k.jsonl", "\n\n", "", "holds no conversation"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_refused_with_its_path_and_line(
    tmp_path: Path, name: str, text: str, where: str, reason: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PromptFileError, match=f"^{path}{where}.*{reason}"):
        read_prompt_file(path)
    with pytest.raises(PromptFileError, match="cannot read"):
        read_prompt_file(tmp_path / "missing.jsonl")


def user(*turns: str, system: str | None = None) -> UserConversation:
    return UserConversation(tuple(turns), system)


def test_repeats_are_dropped_on_normalised_text() -> None:
    template = training_prompts(5)[0][-1]["content"]
    builtin = heldout_prompts()[0][0]["content"]
    conversations = [
        user("Tell me  a joke"),
        user("tell me a JOKE"),  # a repeat of the first
        user("Tell me a joke", system="Be a pirate."),  # another opening: kept
        user(f"  {template.upper()} "),  # a template message
        user("Something new", builtin),  # holds a built-in held-out message
        user("Ｆｕｌｌｗｉｄｔｈ text"),
        user("fullwidth   TEXT", "and more"),  # NFKC: a repeat of the one before
    ]
    split = split_user_prompts(conversations, [template], [builtin], 0.0)
    assert split.heldout == []
    assert split.train == [conversations[0], conversations[2], conversations[5]]
    assert (split.repeats, split.heldout_overlap) == (3, 1)
    assert normalised(" A\u00a0b\tC ") == "a b c"


def test_the_heldout_share_shares_no_conversation_nor_user_message() -> None:
    """Conversations linked by a shared user message go to one side together; a group holding a
    template message stays in training."""
    conversations = [user(f"question number {i}", f"follow-up {i % 7}") for i in range(40)]
    conversations += [user(f"alone {i}") for i in range(40)]
    conversations += [user("uses a template", "Known message")]
    split = split_user_prompts(conversations, ["known MESSAGE"], [], 0.25, seed=3)
    assert 0 < len(split.heldout) <= 0.25 * len(conversations) + 1
    train_keys = set().union(*(user_message_keys(c) for c in split.train))
    held_keys = set().union(*(user_message_keys(c) for c in split.heldout))
    assert not train_keys & held_keys
    assert not set(split.heldout) & set(split.train)
    assert len(split.train) + len(split.heldout) == len(conversations)
    assert conversations[-1] in split.train
    again = split_user_prompts(conversations, ["known MESSAGE"], [], 0.25, seed=3)
    assert again.heldout == split.heldout
    assert split_user_prompts(conversations, [], [], 0.25, seed=4).heldout != split.heldout
    with pytest.raises(ValueError, match="held-out share"):
        split_user_prompts(conversations, [], [], 1.0)


def test_the_corpus_report_counts_sources_tokens_diversity_and_formats() -> None:
    def part(source: str, messages: list[list[dict]], lens: list[tuple[int, int]]) -> CorpusPart:
        tokens = [[1] * (p + a) for p, a in lens]
        return CorpusPart(source, messages, Sequences(tokens, [p for p, _ in lens], {}))

    u = [{"role": "user", "content": text} for text in (
        "Write a poem about the sea",
        "Write a poem about the sky",
        "What is 12 + 30?",
        "Translate hello into French",
        "Why is the sky blue?",
        "Bonjour, ça va",
    )]  # fmt: skip
    parts = [
        part("templates", [[u[0]], [u[1]]], [(3, 5), (4, 6)]),
        part("user file", [[{"role": "system", "content": "s"}, u[2]], [u[3]]], [(2, 2), (1, 1)]),
        part("user file", [[u[4], {"role": "assistant", "content": "a"}, u[5]]], [(7, 3)]),
        CorpusPart("other folders", None, Sequences([[1] * 9], [4], {})),
    ]
    report = corpus_report(parts)
    assert report["sources"] == {
        "templates": {"conversations": 2, "prompt_tokens": 7, "answer_tokens": 11},
        "user file": {"conversations": 3, "prompt_tokens": 10, "answer_tokens": 6},
        "other folders": {"conversations": 1, "prompt_tokens": 4, "answer_tokens": 5},
    }
    assert report["total"] == {"conversations": 6, "prompt_tokens": 21, "answer_tokens": 22}
    assert report["described_conversations"] == 5
    assert report["distinct_user_messages"] == 5
    last = [u[0]["content"], u[1]["content"], u[2]["content"], u[3]["content"], u[5]["content"]]
    # By hand for the two poems: 2-grams 5 + 5, of which 4 shared ("write a", "a poem", ...).
    assert distinct_ngrams(last[:2], 2) == pytest.approx(6 / 10)
    assert distinct_ngrams(last[:2], 3) == pytest.approx(5 / 8)
    assert report["distinct_2gram_ratio"] == pytest.approx(round(distinct_ngrams(last, 2), 4))
    assert report["distinct_3gram_ratio"] == pytest.approx(round(distinct_ngrams(last, 3), 4))
    assert distinct_ngrams(["one"], 2) == 0.0
    shares = report["format_shares"]
    assert shares["writing"] == 0.4 and shares["math"] == 0.2 and shares["translation"] == 0.2
    assert shares["other"] == 0.2 and shares["question"] == 0.0
    assert sum(shares.values()) == pytest.approx(1.0)
    assert report["multi_turn_share"] == 0.2 and report["system_prompt_share"] == 0.2
    assert report["non_ascii_share"] == 0.2
    lines = report_lines(report)
    assert lines[0] == "corpus: 6 conversations, 22 answer tokens, 21 prompt tokens"
    assert "  user file: 3 conversations, 6 answer tokens" in lines
    assert request_format("Fix this Python code") == "code"
    assert request_format("Give me 5 ideas for dinner") == "list"
    assert request_format("Summarize this article") == "summary"
    assert request_format("Is it raining?") == "question"


def test_a_run_answers_every_turn_of_a_users_prompts(
    predictable_path: Path, tmp_path: Path, capsys
) -> None:
    """--prompts with templates: repeats dropped, a held-out share answered but never trained
    on, second turns asked after the target's own first answers, the mix in summary.json."""
    template = training_prompts(6)[2][-1]["content"]
    items = [[("human", f"user question {i}"), ("gpt", "their answer"), ("human", f"more {i}")]
             for i in range(6)]  # fmt: skip
    items += [[("human", f"single {i}")] for i in range(10)]
    items += [[("human", "USER question 0")], [("human", template)]]
    path = tmp_path / "chats.json"
    path.write_text(sharegpt(*items))
    out = tmp_path / "run"
    args = [
        "train-draft", "--out", str(out), "--model", str(predictable_path), "--device", "cpu",
        "--num-prompts", "6", "--self-prompts", "0", "--num-heldout", "2", "--max-tokens", "6",
        "--prompts", str(path), "--prompts-heldout-share", "0.25", "--generate-only",
        "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "corpus: " in printed and "user file:" in printed
    summary = json.loads((out / "summary.json").read_text())
    counts = summary["data"]["user_prompts"]
    assert (counts["read"], counts["repeats"]) == (18, 2)
    assert counts["train_conversations"] + counts["heldout_conversations"] == 16
    assert counts["heldout_conversations"] == 4
    record = json.loads((out / "user_prompts.json").read_text())
    train_keys = {normalised(t) for c in record["train"] for t in c["user_turns"]}
    held_keys = {normalised(t) for c in record["heldout"] for t in c["user_turns"]}
    assert held_keys and not held_keys & train_keys
    assert normalised(template) not in held_keys | train_keys
    corpus = summary["corpus"]
    two_turns = sum(len(c["user_turns"]) == 2 for c in record["train"])
    assert corpus["sources"]["templates"]["conversations"] == 6
    assert corpus["sources"]["user file"]["conversations"] == counts["train_turns"]
    assert counts["train_turns"] == len(record["train"]) + two_turns
    assert summary["data"]["train_conversations"] == corpus["total"]["conversations"]
    assert summary["data"]["heldout_conversations"] == 2 + counts["heldout_turns"]
    assert 0 < corpus["multi_turn_share"] < 1
    # A second turn follows the target's own first answer, not the file's.
    first = Sequences.load(out / "user_answers.pt")
    second = Sequences.load(out / "user_answers_2.pt")
    assert len(second) == two_turns and len(first) == len(record["train"])
    multi = [i for i, c in enumerate(record["train"]) if len(c["user_turns"]) == 2]
    tokenizer = AutoTokenizer.from_pretrained(predictable_path)
    asked = tokenizer.decode(second.tokens[0][: second.prompt_lens[0]])
    own = tokenizer.decode(first.answers()[multi[0]], skip_special_tokens=True).strip()
    assert own and own in asked and "their answer" not in asked
    assert record["train"][multi[0]]["user_turns"][1] in asked
    # Another held-out share lists other conversations: refused over the same folder.
    assert main([*args[:-3], "0.5", "--generate-only", "--no-progress"]) == 2
    assert "lists other user conversations" in capsys.readouterr().err


def test_turns_are_asked_in_rounds_after_the_targets_own_answers() -> None:
    """answer_by_turns with a stand-in for the target: round t asks turn t of every
    conversation still going, after the answers given so far; a turn whose prompt does not fit
    ends its conversation there, and turns past max_turns are never asked."""
    asked: list[tuple[str, list]] = []

    def answers(conversations: list, file: str) -> Sequences:
        asked.append((file, conversations))
        # An "answer" token per conversation: its index in this round, plus 100.
        return Sequences(
            [[1, 100 + i] for i in range(len(conversations))], [1] * len(conversations)
        )

    conversations = [
        user("a1", "a2", "a3", system="S"),
        user("b1", "LONG b2", "b3"),
        user("c1"),
        user("d1", "d2"),
    ]
    rounds, by_round, cut = answer_by_turns(
        conversations,
        answers,
        decode=lambda tokens: f"answer {tokens[0]}",
        fits=lambda c: "LONG" not in c[-1]["content"],
        max_turns=2,
        prefix="user_answers",
    )
    assert [file for file, _ in asked] == ["user_answers.pt", "user_answers_2.pt"]
    assert [len(r) for r in rounds] == [4, 2] and by_round == [c for _, c in asked]
    assert cut == 1  # b2; b3 and a3 lie past max_turns
    second = by_round[1]
    assert second[0] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a1"},
        {"role": "assistant", "content": "answer 100"},
        {"role": "user", "content": "a2"},
    ]
    assert second[1][-3:] == [
        {"role": "user", "content": "d1"},
        {"role": "assistant", "content": "answer 103"},
        {"role": "user", "content": "d2"},
    ]
