"""IncrementalDetokenizer: streamed text equals the full decode, never shows a broken character
or any part of a stop string."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.loading.default_model import default_model_path

MULTILINGUAL = "Héllo wörld! 😀🎉 日本語のテキスト, naïve café — ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 end."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def stream(tokenizer, token_ids: list[int], stop: tuple[str, ...] = (), step: int = 1):
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    chunks = [detokenizer.push(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return chunks, detokenizer.finish()


@pytest.mark.parametrize("step", [1, 3])
def test_multibyte_text_streams_exactly_and_never_broken(tokenizer, step):
    token_ids = tokenizer.encode(MULTILINGUAL)
    # The test means something only if some characters span several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    chunks, tail = stream(tokenizer, token_ids, step=step)
    assert "".join(chunks) + tail == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert all("\ufffd" not in chunk for chunk in chunks + [tail])
    assert tail == ""  # complete text is never held back without stop strings


def test_special_tokens_are_skipped(tokenizer):
    token_ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    chunks, tail = stream(tokenizer, token_ids)
    assert "".join(chunks) + tail == "Hi there"


@pytest.mark.parametrize("stop", ["😀", "wörld", "テキ", "end.", "é"])
def test_stop_string_split_across_tokens_is_never_emitted(tokenizer, stop):
    token_ids = tokenizer.encode(MULTILINGUAL)
    chunks, tail = stream(tokenizer, token_ids, stop=(stop, "a stop that never appears"))
    text = "".join(chunks) + tail
    assert text == MULTILINGUAL[: MULTILINGUAL.index(stop)]
    # Text only ever grows, so a shown piece of the stop string would make some prefix of the
    # stream longer than (or different from) the final text.
    emitted = ""
    for chunk in chunks:
        emitted += chunk
        assert text.startswith(emitted)
    assert all("\ufffd" not in chunk for chunk in chunks)


def test_first_of_several_stop_strings_wins_and_later_tokens_are_ignored(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, ["world", "Hello"])
    text = detokenizer.push(tokenizer.encode("Say Hello world"))
    assert detokenizer.stopped
    assert text + detokenizer.push(tokenizer.encode(" and more")) + detokenizer.finish() == "Say "


def test_finish_flushes_held_back_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, ["STOPPING"])
    shown = detokenizer.push(tokenizer.encode("The answer is forty-two"))
    # Up to len("STOPPING") - 1 characters stay back: they could begin the stop string.
    assert "The answer is forty-two".startswith(shown)
    assert len(shown) >= len("The answer is forty-two") - (len("STOPPING") - 1)
    assert shown + detokenizer.finish() == "The answer is forty-two"
    assert detokenizer.text == "The answer is forty-two"


def test_incomplete_character_at_the_end_flushes_like_a_full_decode(tokenizer):
    token_ids = tokenizer.encode("ok 😀")
    cut = token_ids[:-1]  # ends inside the emoji's bytes
    assert tokenizer.decode(cut).endswith("\ufffd")
    chunks, tail = stream(tokenizer, cut)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) + tail == tokenizer.decode(cut)
