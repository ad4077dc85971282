"""The training and held-out prompts read from spec/train/prompt_data.json are the ones the
module held as literals before: the same lists with the same types, and the same conversations
out of `training_prompts` and `heldout_prompts` (digests taken from the literals)."""

import hashlib
import json

import pytest

from spec.train import prompt_data, prompts

COUNTS = {
    "CONCEPTS": 96, "ACTIVITIES": 60, "CHOICES": 24, "PAIRS": 30, "NAMES": 40, "OBJECTS": 30,
    "PURPOSES": 20, "CODE_TASKS": 28, "LANGUAGES": 6, "PYTHON_FEATURES": 10, "SENTENCES": 16,
    "PARAGRAPHS": 6, "SCENARIOS": 20, "COUNTRIES": 30, "WORDS": 30, "HOWTO_TASKS": 25,
    "CONCEPT_TEMPLATES": 15, "AUDIENCES": 5, "ACTIVITY_TEMPLATES": 9, "COMPARE_TEMPLATES": 5,
    "PROS_CONS_TEMPLATES": 4, "POEM_TEMPLATES": 5, "STORY_TEMPLATES": 5, "LETTER_TEMPLATES": 4,
    "MATH_TEMPLATES": 15, "CODE_TEMPLATES": 3, "PYTHON_FEATURE_TEMPLATES": 2,
    "TRANSLATE_TEMPLATES": 3, "TRANSLATE_LANGUAGES": 6, "REWRITE_TEMPLATES": 2,
    "REWRITE_STYLES": 5, "SUMMARIZE_TEMPLATES": 5, "WHAT_IF_TEMPLATES": 3,
    "COUNTRY_TEMPLATES": 5, "WORD_TEMPLATES": 3, "HOWTO_TEMPLATES": 4, "FOREIGN": 4,
    "SYSTEM_PROMPTS": 6, "OPENERS": 5, "HELDOUT_SINGLE": 32, "HELDOUT_SYSTEM": 9,
    "HELDOUT_MULTI_TURN": 9, "HELDOUT_FOREIGN": 7, "HELDOUT_CODE": 6,
}  # fmt: skip
TUPLES = {"PAIRS": 2, "OPENERS": 2, "HELDOUT_SYSTEM": 2, "HELDOUT_MULTI_TURN": 3}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def test_every_list_has_its_count_and_types():
    for name, count in COUNTS.items():
        value = getattr(prompts, name)
        assert len(value) == count, name
        if name == "HELDOUT_CODE":
            assert isinstance(value, set) and all(isinstance(s, str) for s in value)
        elif name in TUPLES:
            assert isinstance(value, list), name
            for item in value:
                assert isinstance(item, tuple) and len(item) == TUPLES[name], name
                assert all(isinstance(s, str) for s in item), name
        elif name not in ("FOREIGN", "HELDOUT_FOREIGN"):
            assert isinstance(value, list) and all(isinstance(s, str) for s in value), name
    for templates, topics in prompts.FOREIGN:
        assert all(isinstance(s, str) for s in templates + topics)
    assert all(
        isinstance(item, tuple) and (item[0] is None or isinstance(item[0], str))
        for item in prompts.HELDOUT_FOREIGN
    )


def test_spot_checks():
    assert prompts.CONCEPTS[0] == "photosynthesis"
    assert prompts.PAIRS[0] == ("Python", "JavaScript")
    assert prompts.FOREIGN[3][1][:2] == ["光合作用", "通货膨胀"]
    assert prompts.HELDOUT_FOREIGN[0][0] is None
    assert prompts.HELDOUT_FOREIGN[5] == (
        "Eres un profesor de historia.",
        "¿Por qué cayó el Imperio romano de Occidente?",
    )
    assert prompts.HELDOUT_MULTI_TURN[2][2] == "How many moles are in 36 grams of water?"
    assert prompts.OPENERS[-1] == ("Hey, quick question.", "Sure, go ahead.")
    assert "Review this:\n\ndef avg(xs):\n    return sum(xs) / len(xs)" in prompts.HELDOUT_CODE


def test_the_generated_conversations_are_those_of_the_literals():
    assert prompts.max_training_prompts() == 28026
    every = prompts.training_prompts(prompts.max_training_prompts(), seed=3)
    assert _digest(every) == "15932ac10b3edaa49e6c79f3017c79d60090e06c1c326c9e35b6d2f7d80d30c6"
    held_out = [prompts.heldout_prompts(), prompts.heldout_kinds()]
    assert _digest(held_out) == "73c6fcb3a1069d75f7a98076cd16ed51ce263a41a43063bab85f1d7b334d21df"


def test_a_malformed_entry_fails_naming_it(monkeypatch):
    table = {"WORDS": ["tree", 3], "PAIRS": [["a", "b", "c"]], "HELDOUT_FOREIGN": [[None, None]]}
    monkeypatch.setattr(prompt_data, "_table", lambda: table)
    with pytest.raises(ValueError, match="WORDS is not a list of strings"):
        prompt_data.strings("WORDS")
    with pytest.raises(ValueError, match="PAIRS"):
        prompt_data.pairs("PAIRS")
    with pytest.raises(ValueError, match="HELDOUT_FOREIGN"):
        prompt_data.system_and_user("HELDOUT_FOREIGN")
