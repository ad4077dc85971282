import pytest

from spec.train.prompts import (
    HELDOUT_CODE,
    HELDOUT_FOREIGN,
    HELDOUT_KINDS,
    heldout_kinds,
    heldout_prompts,
    max_training_prompts,
    training_prompts,
)

TRAINING_SET_SIZE = 20_000


def frozen(conversation: list[dict]) -> tuple:
    return tuple((m["role"], m["content"]) for m in conversation)


def user_messages(conversations: list[list[dict]]) -> set[str]:
    return {m["content"] for c in conversations for m in c if m["role"] == "user"}


def assert_well_formed(conversation: list[dict]) -> None:
    assert conversation and conversation[-1]["role"] == "user"
    for message in conversation:
        assert set(message) == {"role", "content"}
        assert message["role"] in ("system", "user", "assistant")
        assert isinstance(message["content"], str) and message["content"].strip()
    roles = [m["role"] for m in conversation]
    assert "system" not in roles[1:], "a system message may only come first"
    turns = [r for r in roles if r != "system"]
    assert all(a != b for a, b in zip(turns, turns[1:])), "user and assistant must alternate"


@pytest.fixture(scope="module")
def training() -> list[list[dict]]:
    return training_prompts(TRAINING_SET_SIZE)


def test_same_seed_gives_the_same_prompts():
    assert training_prompts(500, seed=3) == training_prompts(500, seed=3)


def test_different_seeds_give_different_prompts():
    assert training_prompts(500, seed=0) != training_prompts(500, seed=1)


def test_smaller_n_is_a_prefix_of_larger_n(training):
    assert training_prompts(1000) == training[:1000]


def test_twenty_thousand_distinct_conversations(training):
    assert max_training_prompts() >= TRAINING_SET_SIZE
    assert len(training) == TRAINING_SET_SIZE
    assert len({frozen(c) for c in training}) == TRAINING_SET_SIZE
    assert len({c[-1]["content"] for c in training}) == TRAINING_SET_SIZE


def test_all_available_conversations_are_distinct():
    everything = training_prompts(max_training_prompts(), seed=7)
    assert len({c[-1]["content"] for c in everything}) == len(everything)


def test_too_many_or_negative_is_a_value_error():
    with pytest.raises(ValueError, match="distinct conversations"):
        training_prompts(max_training_prompts() + 1)
    with pytest.raises(ValueError):
        training_prompts(-1)


def test_training_conversations_are_well_formed(training):
    for conversation in training:
        assert_well_formed(conversation)


def test_training_mixes_system_prompts_two_turns_and_other_languages(training):
    sample = training[:5000]
    with_system = sum(c[0]["role"] == "system" for c in sample) / len(sample)
    two_turn = sum(any(m["role"] == "assistant" for m in c) for c in sample) / len(sample)
    assert 0.15 < with_system < 0.25
    assert 0.07 < two_turn < 0.13
    assert len({c[0]["content"] for c in sample if c[0]["role"] == "system"}) >= 4
    assert any("\u4e00" <= ch <= "\u9fff" for c in sample for ch in c[-1]["content"])


def test_heldout_conversations_are_well_formed_and_varied():
    heldout = heldout_prompts()
    assert len(heldout) >= 48
    for conversation in heldout:
        assert_well_formed(conversation)
    assert len({frozen(c) for c in heldout}) == len(heldout)
    assert sum(c[0]["role"] == "system" for c in heldout) >= 4
    assert sum(any(m["role"] == "assistant" for m in c) for c in heldout) >= 4


def test_each_heldout_conversation_has_a_kind_that_fits_it():
    conversations, kinds = heldout_prompts(), heldout_kinds()
    assert len(kinds) == len(conversations)
    assert set(kinds) == set(HELDOUT_KINDS)
    # Every code message names a held-out conversation, so no code kind is lost to a typo.
    assert HELDOUT_CODE <= user_messages(conversations)
    for conversation, kind in zip(conversations, kinds):
        roles = [m["role"] for m in conversation]
        if kind == "code":
            assert user_messages([conversation]) & HELDOUT_CODE
        elif kind == "multi-turn":
            assert roles == ["user", "assistant", "user"]
        elif kind == "system prompt":
            assert roles == ["system", "user"]
        elif kind == "single turn":
            assert roles == ["user"]
        else:
            assert conversation[-1]["content"] in {text for _, text in HELDOUT_FOREIGN}


def test_heldout_is_disjoint_from_training(training):
    heldout = heldout_prompts()
    assert not {frozen(c) for c in heldout} & {frozen(c) for c in training}
    assert not user_messages(heldout) & user_messages(training)
    everything = training_prompts(max_training_prompts())
    assert not user_messages(heldout) & user_messages(everything)
