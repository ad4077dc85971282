"""Stop conditions on the tiny model: max_tokens, EOS, stop token ids, stop strings and the
context length. Where a stop must fall, the greedy output with every stop disabled is the
reference, and the expected cut is computed from it here."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.request import Request

PROMPT = "Hello world"
REFERENCE_TOKENS = 48


def _unstopped(llm: LLM, prompt: str = PROMPT, max_tokens: int = REFERENCE_TOKENS) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = llm.generate(prompt, params)
    assert out[0].finish_reason == "length"
    return out[0].token_ids


def _late_first_occurrence(tokens: list[int], min_index: int = 2) -> int:
    """Index of the first token whose first occurrence in `tokens` is at `min_index` or later."""
    for i, token in enumerate(tokens):
        if i >= min_index and token not in tokens[:i]:
            return i
    raise AssertionError(f"every token of {tokens} repeats an earlier one")


def _plain_substring(text: str, length: int = 2, min_index: int = 2) -> tuple[str, int]:
    """A substring of printable ASCII whose first occurrence is at `min_index` or later, so that
    decoding a window that starts mid-character cannot change it."""
    allowed = set(string.ascii_letters + string.digits + string.punctuation)
    for i in range(min_index, len(text) - length + 1):
        candidate = text[i : i + length]
        if set(candidate) <= allowed and text.find(candidate) == i:
            return candidate, i
    raise AssertionError(f"no plain substring in {text!r}")


@pytest.mark.parametrize("max_tokens", [1, 5, 17])
def test_max_tokens_ends_with_length(tiny_llm: LLM, max_tokens: int) -> None:
    out = tiny_llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == max_tokens
    assert out.usage.completion_tokens == max_tokens


def test_stop_token_id_stops_right_after_its_first_occurrence(tiny_llm: LLM) -> None:
    reference = _unstopped(tiny_llm)
    first = _late_first_occurrence(reference)
    stop_token = reference[first]
    params = SamplingParams(
        max_tokens=REFERENCE_TOKENS, temperature=0, stop_token_ids=[stop_token], ignore_eos=True
    )
    out = tiny_llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[: first + 1]
    assert out.token_ids[-1] == stop_token


def test_stop_token_on_the_last_allowed_token_reports_stop(tiny_llm: LLM) -> None:
    reference = _unstopped(tiny_llm)
    first = _late_first_occurrence(reference)
    params = SamplingParams(max_tokens=first + 1, temperature=0, stop_token_ids=[reference[first]])
    out = tiny_llm.generate(PROMPT, params)[0]
    assert (out.finish_reason, out.token_ids) == ("stop", reference[: first + 1])


@pytest.fixture(scope="module")
def eos_case(tiny_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, list[int], int]:
    """The session's tiny model saved again (same seed, so same weights) with its EOS id set to
    a token it emits early under greedy decoding: (engine, unstopped output, index of first EOS)."""
    reference = _unstopped(tiny_llm)
    first = _late_first_occurrence(reference)
    path: Path = tmp_path_factory.mktemp("tiny_llama_eos")
    make_tiny_llama(path, seed=0, eos_token_id=reference[first])
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024, max_num_seqs=4)
    assert llm.model_config.eos_token_ids == (reference[first],)
    return llm, reference, first


def test_eos_stops_generation(eos_case: tuple[LLM, list[int], int]) -> None:
    llm, reference, first = eos_case
    out = llm.generate(PROMPT, SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[: first + 1]


def test_ignore_eos_generates_past_eos(eos_case: tuple[LLM, list[int], int]) -> None:
    llm, reference, first = eos_case
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "length"
    assert out.token_ids == reference
    assert reference[first] in out.token_ids[:-1]


def test_ignore_eos_still_honours_stop_token_ids(eos_case: tuple[LLM, list[int], int]) -> None:
    llm, reference, first = eos_case
    later = _late_first_occurrence(reference, min_index=first + 1)
    params = SamplingParams(
        max_tokens=REFERENCE_TOKENS,
        temperature=0,
        ignore_eos=True,
        stop_token_ids=[reference[later]],
    )
    out = llm.generate(PROMPT, params)[0]
    assert (out.finish_reason, out.token_ids) == ("stop", reference[: later + 1])


def _stop_string_case(llm: LLM) -> tuple[list[int], str, str, int]:
    """(unstopped tokens, their text, a stop string from it, tokens up to where it completes)."""
    reference = _unstopped(llm)
    text = llm.tokenizer.decode(reference, skip_special_tokens=True)
    stop, _ = _plain_substring(text)
    completes_at = next(
        k
        for k in range(1, len(reference) + 1)
        if stop in llm.tokenizer.decode(reference[:k], skip_special_tokens=True)
    )
    return reference, text, stop, completes_at


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "str"])
def test_stop_string_cuts_text_before_it(tiny_llm: LLM, as_list: bool) -> None:
    reference, text, stop, completes_at = _stop_string_case(tiny_llm)
    params = SamplingParams(
        max_tokens=REFERENCE_TOKENS,
        temperature=0,
        ignore_eos=True,
        stop=[stop] if as_list else stop,
    )
    out = tiny_llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    assert out.token_ids == reference[:completes_at]


def test_earliest_of_several_stop_strings_wins(tiny_llm: LLM) -> None:
    reference, text, stop, completes_at = _stop_string_case(tiny_llm)
    later, later_at = _plain_substring(text, min_index=text.find(stop) + len(stop) + 1)
    params = SamplingParams(
        max_tokens=REFERENCE_TOKENS, temperature=0, ignore_eos=True, stop=[later, stop]
    )
    out = tiny_llm.generate(PROMPT, params)[0]
    assert later_at > text.find(stop)
    assert (out.finish_reason, out.text) == ("stop", text[: text.find(stop)])
    assert out.token_ids == reference[:completes_at]


@pytest.mark.parametrize("stop", ["日本語", "€€€", "é-é-é", "ab"])
def test_stop_string_of_multibyte_characters_is_found(tiny_llm: LLM, stop: str) -> None:
    """With a byte-level tokenizer a character may take up to four tokens: the stop check must
    look back far enough in tokens, not in characters."""
    text = "xy" + stop + "tail"
    tokens = tiny_llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) == len(text.encode())
    completes_at = len(("xy" + stop).encode())
    req = Request("r", [5, 6], SamplingParams(max_tokens=100, stop=[stop]))
    reason = None
    for token in tokens:
        req.output_token_ids.append(token)
        reason = tiny_llm.engine.stop_checker.check(req)
        if reason is not None:
            break
    stopped_after = len(req.output_token_ids)
    assert (reason, stopped_after) == ("stop", completes_at)
    assert tiny_llm.engine.stop_checker.final_text(req) == "xy"


def test_absent_stop_string_changes_nothing(tiny_llm: LLM) -> None:
    reference = _unstopped(tiny_llm)
    text = tiny_llm.tokenizer.decode(reference, skip_special_tokens=True)
    absent = "never in the output"
    assert absent not in text
    params = SamplingParams(
        max_tokens=REFERENCE_TOKENS, temperature=0, ignore_eos=True, stop=[absent]
    )
    out = tiny_llm.generate(PROMPT, params)[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("length", reference, text)


def test_request_filling_max_model_len_exactly(tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path), device="cpu", max_model_len=32, max_num_seqs=2)
    prompt = list(range(3, 23))  # 20 tokens
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 12
    assert out.usage.total_tokens == len(out.prompt_token_ids) + len(out.token_ids) == 32
    assert llm.engine.kv_cache.is_empty()


class _Tokenizer:
    """Enough of a tokenizer for stop strings: token t is the character chr(ord('a') + t % 26)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.mark.parametrize("seed", range(6))
def test_committing_several_tokens_stops_where_a_check_per_token_does(seed: int) -> None:
    """`StopChecker.commit` (a speculative round's several tokens at once) keeps the tokens
    and reports the reason that committing them one by one with `check` after each does: EOS
    (unless ignored), stop token ids, max_tokens and the context length, in that order, and
    stop strings."""
    import random

    from engine.sampling.stopping import StopChecker

    rng = random.Random(seed)
    checker = StopChecker(_Tokenizer(), eos_token_ids=(2, 7), max_model_len=40)
    for _ in range(300):
        stop = rng.choice([(), (), "cd", ["xy", "b"]])
        params = SamplingParams(
            max_tokens=rng.randint(1, 12),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(12), rng.randint(0, 2)),
            stop=stop,
        )
        prompt = [3] * rng.choice([5, 30, 36])
        if len(prompt) + params.max_tokens > 40:
            params = SamplingParams(max_tokens=40 - len(prompt), stop=stop)
        output = [rng.randrange(12) for _ in range(rng.randint(0, params.max_tokens - 1))]
        new = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
        one_by_one = Request("a", prompt, params, output_token_ids=list(output))
        reason = None
        for token in new:
            one_by_one.commit(token)
            reason = checker.check(one_by_one)
            if reason is not None:
                break
        at_once = Request("b", prompt, params, output_token_ids=list(output))
        assert checker.commit(at_once, new) == reason
        assert at_once.output_token_ids == one_by_one.output_token_ids
        assert at_once.stopped_by_string == one_by_one.stopped_by_string
