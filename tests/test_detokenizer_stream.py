"""engine.detokenizer: streamed text equals HF `decode` cut before the first stop string, for the
default model's byte-level BPE on the Rust stream decoder and for other tokenizer kinds (built
here, offline) on whichever path each one takes; never a broken character or part of a stop."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast

import engine.detokenizer as detokenizer_module
from engine.detokenizer import IncrementalDetokenizer, tokenizer_decoding
from engine.loading.default_model import default_model_path

MULTILINGUAL = "Héllo wörld! 😀🎉 日本語のテキスト, naïve café — ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 end."
SNIPPETS = [MULTILINGUAL, "The cat's mat isn't red . Yes ! ", "中文字符和emoji🙂🚀", "a\n\n  b\tc"]
NEVER = "\x00never\x00"  # a stop string that no sequence here decodes to


@pytest.fixture(scope="module")
def smol():
    return AutoTokenizer.from_pretrained(default_model_path())


def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """Llama-style SentencePiece BPE: "▁" for spaces, byte-fallback tokens <0x00>..<0xFF> for
    characters outside the vocabulary, the leading space stripped by the decoder."""
    words = ["▁the", "▁cat", "▁sat", "▁", "▁▁", "the", "s", "ing", "▁a", "a", ".", "'", "日本"]
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    model = models.BPE(
        vocab={t: i for i, t in enumerate(vocab)}, merges=[], unk_token="<unk>", byte_fallback=True
    )
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def unigram_metaspace(**kwargs) -> PreTrainedTokenizerFast:
    """T5-style Unigram with the Metaspace pre-tokenizer and decoder."""
    pieces = ["▁the", "▁cat", "▁sat", "▁", "▁.", "▁'", "s", "n't", ".", "'", "日本", "▁語", "é"]
    pieces += list("abcdefghijklmnopqrstuvwxyz")
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(p, -1.0 - i / 100) for i, p in enumerate(pieces)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", **kwargs
    )


def wordpiece(**kwargs) -> PreTrainedTokenizerFast:
    """BERT-style WordPiece; its vocabulary has every piece transformers' clean-up acts on."""
    words = ["the", "cat", "sat", "##s", "##ing", "a", ".", ",", "'", "n", "##'", "t", "##t", "s"]
    words += ["m", "ve", "re", "!", "?", "日", "##本"]
    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "[PAD]"] + words)}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    special = dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]")
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special, **kwargs)


def byte_ids(tokenizer) -> list[int]:
    """Ids that stand for one byte: byte-level BPE's single-character tokens, SentencePiece's
    byte-fallback tokens."""
    return [
        i
        for t, i in tokenizer.get_vocab().items()
        if (len(t) == 1 and i not in tokenizer.all_special_ids) or t.startswith("<0x")
    ]


def random_ids(tokenizer, rng: random.Random, length: int, bytes_: list[int]) -> list[int]:
    """Text (emoji, CJK, split over tokens), single bytes (lone lead and continuation bytes),
    special tokens and EOS, and any id at all, mixed."""
    specials = list(tokenizer.all_special_ids) + list(tokenizer.added_tokens_decoder)
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.3:
            snippet = rng.choice(SNIPPETS)
            start = rng.randrange(len(snippet))
            ids += tokenizer.encode(snippet[start : start + 12], add_special_tokens=False)
        elif kind < 0.55:
            ids += rng.choices(bytes_, k=rng.randint(1, 4))
        elif kind < 0.65:
            ids.append(rng.choice(specials))
        else:
            ids.append(rng.randrange(len(tokenizer)))
    return ids[:length]


def push_all(detokenizer, ids: list[int], rng: random.Random | None) -> list[str]:
    """Push one id at a time (rng None) or in random groups, as a speculative step commits."""
    return [detokenizer.push(ids[start:end]) for start, end in groups(len(ids), rng)]


def groups(length: int, rng: random.Random | None) -> list[tuple[int, int]]:
    bounds, end = [], 0
    while end < length:
        start, end = end, end + (1 if rng is None else rng.choice([1, 1, 2, 3, 5, 8]))
        bounds.append((start, min(end, length)))
    return bounds


def check_stream(tokenizer, ids: list[int], stop: str | None, rng: random.Random | None):
    """The contract for one sequence; returns whether the stop string straddled two pushes."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert NEVER not in full
    stops = (NEVER,) if stop is None else (stop, NEVER)
    expected = full if stop is None else full[: full.index(stop)]
    detokenizer = tokenizer_decoding(tokenizer).detokenizer(stops)
    pushes = groups(len(ids), rng)
    chunks = [detokenizer.push(ids[start:end]) for start, end in pushes]
    shown = ""
    for chunk in chunks:
        shown += chunk
        # What was shown is never taken back: no broken character, no part of a stop string.
        assert expected.startswith(shown), (ids, stops, chunks)
    assert shown + detokenizer.finish() == expected, (ids, stops)
    assert detokenizer.text == expected
    assert detokenizer.stopped == (stop is not None)
    if stop is None:
        return False
    start = full.index(stop)
    ends = (len(tokenizer.decode(ids[:end], skip_special_tokens=True)) for _, end in pushes)
    return any(start < end < start + len(stop) for end in ends)


def check_random_streams(tokenizer, seed: int, count: int, length: int = 48) -> None:
    rng = random.Random(seed)
    straddled = 0
    bytes_ = byte_ids(tokenizer)
    for n in range(count):
        ids = random_ids(tokenizer, rng, length, bytes_)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stop = None
        if n % 2 and len(full) > 8:
            start = rng.randrange(len(full) - 4)
            stop = full[start : start + rng.randint(2, 4)]
        straddled += check_stream(tokenizer, ids, stop, rng if n % 4 >= 2 else None)
    assert straddled >= count // 8  # the stop strings do span pushes


def test_default_tokenizer_streams_random_sequences_exactly(smol):
    assert tokenizer_decoding(smol).uses_stream
    check_random_streams(smol, seed=0, count=160)


@pytest.mark.parametrize(
    "make", [sentencepiece_bpe, unigram_metaspace, wordpiece], ids=lambda f: f.__name__
)
def test_other_tokenizer_kinds_stream_exactly_on_the_stream_decoder(make):
    tokenizer = make()
    decoding = tokenizer_decoding(tokenizer)
    assert decoding.uses_stream, decoding.reason
    check_random_streams(tokenizer, seed=1, count=160)


def test_clean_up_of_tokenization_spaces_takes_the_windowed_path_and_stays_exact():
    tokenizer = wordpiece(clean_up_tokenization_spaces=True)
    decoding = tokenizer_decoding(tokenizer)
    assert not decoding.uses_stream
    assert "clean" in decoding.reason
    vocab = tokenizer.get_vocab()
    # "cat ' s" cleans up to "cat's": a window method that cleans each window would show " '".
    ids = [vocab["cat"], vocab["'"], vocab["s"]]
    assert tokenizer.decode(ids) == "cat's"
    detokenizer = decoding.detokenizer()
    assert "".join(detokenizer.push([i]) for i in ids) + detokenizer.finish() == "cat's"
    check_random_streams(tokenizer, seed=2, count=160)


def test_bpe_clean_up_flag_that_transformers_ignores_keeps_the_stream_path():
    tokenizer = sentencepiece_bpe()
    tokenizer.clean_up_tokenization_spaces = True  # transformers 5 skips it for BPE models
    assert tokenizer_decoding(tokenizer).uses_stream
    check_random_streams(tokenizer, seed=3, count=40)


def test_slow_tokenizer_takes_the_windowed_path_and_stays_exact():
    tokenizer = ByT5Tokenizer()
    decoding = tokenizer_decoding(tokenizer)
    assert not decoding.uses_stream and "slow" in decoding.reason
    check_random_streams(tokenizer, seed=4, count=40)


def test_tokenizer_with_its_own_decode_takes_the_windowed_path_on_that_decode():
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    tokenizer = Shouting(tokenizer_object=unigram_metaspace().backend_tokenizer)
    decoding = tokenizer_decoding(tokenizer)
    assert not decoding.uses_stream and "its own way" in decoding.reason
    check_random_streams(tokenizer, seed=5, count=40)


def test_stream_path_never_calls_the_python_decode(smol, monkeypatch):
    decoding = tokenizer_decoding(smol)  # decided (and probed) before decode is taken away

    def no_decode(*args, **kwargs):
        raise AssertionError("the Python decode was called")

    monkeypatch.setattr(smol, "decode", no_decode)
    ids = smol.encode(MULTILINGUAL)
    detokenizer = decoding.detokenizer(["end."])
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.finish()
    assert text == MULTILINGUAL[: MULTILINGUAL.index("end.")]
    assert detokenizer.uses_stream
    cut = smol.encode("ok 😀")[:-1]  # the finish decodes the pending tail in Rust too
    detokenizer = decoding.detokenizer()
    assert "".join(detokenizer.push([i]) for i in cut) == "ok"
    assert detokenizer.finish() == " \ufffd"


@pytest.mark.parametrize("make", ["smol", sentencepiece_bpe], ids=["byte_level", "byte_fallback"])
def test_incomplete_character_at_the_end_flushes_like_a_full_decode(smol, make):
    tokenizer = smol if make == "smol" else make()
    ids = tokenizer.encode("ok 😀 日本", add_special_tokens=False)
    for end in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:end], skip_special_tokens=True)
        detokenizer = tokenizer_decoding(tokenizer).detokenizer()
        chunks = [detokenizer.push([i]) for i in ids[:end]]
        assert all("\ufffd" not in chunk for chunk in chunks)
        assert "".join(chunks) + detokenizer.finish() == full


def test_byte_fallback_run_is_shown_only_once_a_token_ends_it():
    # A byte-fallback decoder shows <0x41> alone as "A", but <0x41><0xE2> followed by a word as
    # two U+FFFD: showing "A" first would be wrong (and makes the Rust stream decoder raise).
    tokenizer = sentencepiece_bpe()
    vocab = tokenizer.get_vocab()
    ids = [vocab["<0x41>"], vocab["<0xE2>"], vocab["▁the"]]
    assert tokenizer.decode(ids) == "\ufffd\ufffd the"
    detokenizer = tokenizer_decoding(tokenizer).detokenizer()
    assert [detokenizer.push([i]) for i in ids] == ["", "", "\ufffd\ufffd the"]
    assert detokenizer.uses_stream


def test_special_tokens_are_skipped_and_eos_ends_nothing_early(smol):
    ids = [1] + smol.encode("Hi there") + [2, 0] + smol.encode(" again") + [smol.eos_token_id]
    detokenizer = tokenizer_decoding(smol).detokenizer()
    assert "".join(push_all(detokenizer, ids, None)) + detokenizer.finish() == "Hi there again"


def test_stop_string_wins_over_later_tokens_and_finish_after_it_adds_nothing(smol):
    detokenizer = IncrementalDetokenizer(smol, ["world", "Hello"])
    text = detokenizer.push(smol.encode("Say Hello world"))
    assert detokenizer.stopped and text == "Say "
    assert detokenizer.push(smol.encode(" and more")) == ""
    assert detokenizer.finish() == "" and detokenizer.finish() == ""
    assert detokenizer.text == "Say "
    with pytest.raises(RuntimeError):
        detokenizer.push([1])


def test_held_back_text_is_flushed_by_finish(smol):
    detokenizer = IncrementalDetokenizer(smol, ["STOPPING"])
    shown = detokenizer.push(smol.encode("The answer is forty-two"))
    assert len(shown) >= len("The answer is forty-two") - (len("STOPPING") - 1)
    assert shown + detokenizer.finish() == "The answer is forty-two"


@pytest.mark.parametrize("clean_up", [False, True], ids=["stream", "windowed"])
def test_long_stream_keeps_a_short_window(clean_up):
    tokenizer = wordpiece(clean_up_tokenization_spaces=clean_up)
    rng = random.Random(6)
    ids = [rng.randrange(4, len(tokenizer)) for _ in range(20_000)]
    detokenizer = tokenizer_decoding(tokenizer).detokenizer(["\x00"])
    longest = 0
    for i in ids:
        detokenizer.push([i])
        longest = max(longest, len(detokenizer._source._ids))
    assert detokenizer.text + detokenizer.finish() == tokenizer.decode(ids)
    assert longest <= 4  # work per token does not grow with the stream


def test_exactness_is_decided_once_per_tokenizer_which_it_does_not_keep_alive(monkeypatch):
    decided = []
    decide = detokenizer_module._decide
    monkeypatch.setattr(detokenizer_module, "_decide", lambda t: decided.append(t) or decide(t))
    tokenizer = unigram_metaspace()
    for _ in range(3):
        IncrementalDetokenizer(tokenizer).push([5])
        tokenizer_decoding(tokenizer).detokenizer(["x"])
    assert len(decided) == 1
    decided.clear()
    alive = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert alive() is None


def test_stream_decoder_error_falls_back_to_the_windowed_decode():
    # Forced onto the stream path without holding byte runs, the Rust decoder raises on the
    # sequence above; the request goes on with the windowed decode instead of failing.
    tokenizer = sentencepiece_bpe()
    forced = detokenizer_module._Choice(True, "backend", False, frozenset(), "")
    detokenizer = detokenizer_module.TokenizerDecoding(tokenizer, forced).detokenizer()
    vocab = tokenizer.get_vocab()
    assert detokenizer.push([vocab["<0x41>"]]) == "A"
    assert detokenizer.uses_stream
    detokenizer.push([vocab["<0xE2>"], vocab["▁the"]])
    assert not detokenizer.uses_stream
    detokenizer.push([vocab["▁cat"]])
    assert (detokenizer.text + detokenizer.finish()).endswith(" the cat")


def test_space_clean_up_in_pieces_equals_clean_up_of_the_whole_text():
    clean_up = wordpiece().clean_up_tokenization
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choices([" ", "'", "n", "t", "s", "v", "e", ".", "x", "m", "r"], k=30))
        pieces = detokenizer_module._SpaceCleanUp(clean_up)
        out, i = "", 0
        while i < len(text):
            step = rng.randint(1, 5)
            out += pieces.add(text[i : i + step])
            assert clean_up(text).startswith(out), text
            i += step
        assert out + pieces.flush() == clean_up(text), text
