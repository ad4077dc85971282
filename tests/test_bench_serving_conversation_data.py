"""The built-in chat conversations read from cluster/bench_serving/chat_conversations.jsonl are
the ones the module held as literals before (count, digest of every field taken from the
literals, spot checks, types); a malformed line fails naming its line."""

import hashlib
import json

import pytest

from cluster.bench_serving import chat_conversations
from cluster.bench_serving.chat_conversations import CONVERSATIONS, Conversation


def test_the_conversations_are_those_of_the_literals():
    assert isinstance(CONVERSATIONS, tuple) and len(CONVERSATIONS) == 50
    for conversation in CONVERSATIONS:
        assert isinstance(conversation, Conversation)
        assert isinstance(conversation.turns, tuple) and len(conversation.turns) % 2 == 1
        assert all(isinstance(turn, str) for turn in conversation.turns)
        assert isinstance(conversation.output_len, int)
    fields = [[c.topic, list(c.turns), c.output_len] for c in CONVERSATIONS]
    digest = hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()
    assert digest == "4abe4791f428c05899752809c67b9c6b1ec4726cb85bf20cc59bc66714360641"
    first, story = CONVERSATIONS[0], CONVERSATIONS[17]
    assert first.topic == "python csv grouping" and first.output_len == 320
    assert first.turns[0].startswith("I have a CSV of sales with columns date, region, product")
    assert story.topic == "story opening feedback" and story.output_len == 500
    assert CONVERSATIONS[-1].topic == "debugging flaky test"
    assert sum(len(c.turns) for c in CONVERSATIONS) == 160


@pytest.mark.parametrize(
    "line",
    [
        '{"topic": "t", "turns": ["a", "b"], "output_len": 5}',
        '{"topic": "t", "turns": ["a"], "output_len": 0}',
        '{"topic": "t", "turns": ["a"]}',
    ],
)
def test_a_malformed_line_fails_naming_it(line: str):
    with pytest.raises(ValueError, match="chat_conversations.jsonl:2:"):
        chat_conversations._conversation(2, json.loads(line))
