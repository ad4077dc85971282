"""Turn a request's stream of token ids into a stream of text that is always safe to show, cheaply
enough to run for every request at every step of a node's serving loop.

The contract: the concatenation of every `push` and the `finish` equals
`tokenizer.decode(all_ids, skip_special_tokens=True)` cut before the first stop string; no push
shows part of a character that later tokens complete, or any part of a stop string.

Text comes from one of two sources, chosen once per tokenizer (`tokenizer_decoding`):

- the stream decoder of the `tokenizers` library (`DecodeStream`, in Rust: about a microsecond a
  token), for fast tokenizers whose `decode` adds nothing to the Rust one and whose decoder keeps
  a window's text a prefix of a longer window's;
- otherwise the windowed method in Python (two `decode` calls a push), with the clean-up of
  tokenization spaces applied incrementally where the tokenizer does one.

Both decode a window that starts one shown chunk back and show what it adds past that chunk,
holding back while it ends in U+FFFD (a character whose last bytes have not come).
"""

from __future__ import annotations

import functools
import json
import random
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizer, PreTrainedTokenizerFast

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with `push`, get back only new, complete text; `finish` flushes the rest.

    With stop strings, the last (longest stop string - 1) characters are held back, so a stop
    string split over pushes is never shown; once one appears, later tokens are ignored. Where
    several have appeared, the text is cut before the one that starts first.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop_strings: Iterable[str] = (),
        decoding: TokenizerDecoding | None = None,
    ) -> None:
        decoding = decoding or tokenizer_decoding(tokenizer)
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._source = _TextSource(decoding)
        self._clean_up = _SpaceCleanUp(decoding.clean_up) if decoding.clean_up else None
        # Byte-fallback decoders: ids that keep the last byte group open wait here.
        self._open_ids = decoding.byte_group_open_ids or None
        self._unclosed: list[int] = []
        self._shown: list[str] = []
        self._held = ""  # decoded text not shown yet (it could begin a stop string)
        self._stopped = False
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string appeared: the text is final and further tokens are ignored."""
        return self._stopped

    @property
    def text(self) -> str:
        """Everything returned so far."""
        if len(self._shown) > 1:
            self._shown = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""

    @property
    def uses_stream(self) -> bool:
        """Text comes from the `tokenizers` stream decoder (not the windowed Python decode)."""
        return self._source.uses_stream

    def push(self, token_ids: Iterable[int]) -> str:
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self._stopped:
            return ""
        ids = token_ids if type(token_ids) is list else list(token_ids)
        if self._open_ids is not None:
            ids = self._close_byte_groups(ids)
        if not ids:
            return ""
        new = self._source.add(ids)
        if self._clean_up is not None:
            new = self._clean_up.add(new)
        return self._release(new, final=False)

    def finish(self) -> str:
        """Flush the held-back text (an incomplete character at the very end shows as U+FFFD,
        as in a full decode)."""
        if self._finished:
            return ""
        self._finished = True
        if self._stopped:
            return ""
        new = self._source.flush(self._unclosed)
        self._unclosed = []
        if self._clean_up is not None:
            new = self._clean_up.add(new) + self._clean_up.flush()
        return self._release(new, final=True)

    def _close_byte_groups(self, ids: list[int]) -> list[int]:
        # A byte-fallback decoder shows a run of byte tokens as one string when the run is valid
        # UTF-8 and as one U+FFFD per byte otherwise, so a byte's text is known only once a
        # token outside the run ends it (skipped special tokens do not).
        unclosed = self._unclosed
        start = len(unclosed)  # every id before is open
        unclosed += ids
        end = len(unclosed)
        while end > start and unclosed[end - 1] in self._open_ids:
            end -= 1
        if end == start:
            return []
        self._unclosed = unclosed[end:]
        return unclosed[:end]

    def _release(self, new: str, final: bool) -> str:
        if not self.stop_strings:
            if new:
                self._shown.append(new)
            return new
        # A stop string cannot start in shown text: the hold kept it back until it was complete.
        text = self._held + new
        hits = [i for s in self.stop_strings if (i := text.find(s)) >= 0]
        if hits:
            self._stopped = True
            end = min(hits)
        elif final:
            end = len(text)
        else:
            end = max(0, len(text) - self._hold)
        self._held = "" if self._stopped else text[end:]
        if end:
            self._shown.append(text[:end])
        return text[:end]


class _TextSource:
    """New complete text for pushed ids, from the stream decoder while it is in use, else from
    the windowed decode. Both keep the same window: the ids of the last shown chunk (before
    `_read`) and those not shown yet."""

    def __init__(self, decoding: TokenizerDecoding) -> None:
        self._decode = decoding.decode
        self._backend = decoding.backend
        self._stream = DecodeStream(skip_special_tokens=True) if decoding.backend else None
        self._ids: list[int] = []
        self._read = 0

    @property
    def uses_stream(self) -> bool:
        return self._stream is not None

    def add(self, ids: list[int]) -> str:
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, ids[0] if len(ids) == 1 else ids)
            except Exception:
                # The stream decoder refuses a window whose text does not extend the last
                # chunk's; the windowed decode goes on from the same window.
                self._stream = None
            else:
                if text is None:
                    self._ids += ids
                    return ""
                self._ids = self._ids[self._read :] + ids
                self._read = len(self._ids)
                return text
        self._ids += ids
        prefix = self._decode(self._ids[: self._read]) if self._read else ""
        window = self._decode(self._ids)
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            self._ids = self._ids[self._read :]
            self._read = len(self._ids)
            return window[len(prefix) :]
        return ""

    def flush(self, ids: list[int]) -> str:
        self._ids += ids
        if len(self._ids) == self._read:
            return ""
        prefix = self._decode(self._ids[: self._read]) if self._read else ""
        return self._decode(self._ids)[len(prefix) :]


class _SpaceCleanUp:
    """Applies transformers' `clean_up_tokenization` (" ." -> ".", " n't" -> "n't", ...) to text
    that arrives in pieces, giving out exactly what it gives for the whole text.

    Every pattern starts with a space, is at most four characters long and is replaced by itself
    less spaces, so no match (even one made by an earlier replacement) can span a point that
    three non-space characters precede: the text is cleaned up to the last such point, and the
    rest waits for more."""

    def __init__(self, clean_up: Callable[[str], str]) -> None:
        self._clean_up = clean_up
        self._pending = ""

    def add(self, text: str) -> str:
        if not text:
            return ""
        checked = len(self._pending)  # no split point in the pending text (or at its end)
        pending = self._pending + text
        end = len(pending)
        while end > checked:
            space = pending.rfind(" ", 0, end)
            if space < end - 3 or space < 0:
                break
            end = space
        if end <= checked:
            self._pending = pending
            return ""
        self._pending = pending[end:]
        return self._clean_up(pending[:end])

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return self._clean_up(text) if text else ""


class TokenizerDecoding:
    """How one tokenizer's ids become text exactly: `tokenizer_decoding(tokenizer)` decides it
    once per tokenizer, then `detokenizer()` makes each request's detokenizer cheaply."""

    def __init__(self, tokenizer: Any, choice: _Choice) -> None:
        self.tokenizer = tokenizer
        self.reason = choice.reason
        self.byte_group_open_ids = choice.byte_group_open_ids
        # The Rust tokenizer whose stream decoder is exact for this tokenizer, or None.
        self.backend: Tokenizer | None = tokenizer.backend_tokenizer if choice.stream else None
        # The windowed path's decode of a window of ids, and the clean-up that follows it.
        self.decode: Callable[[list[int]], str]
        if choice.decode_with == "backend":
            self.decode = functools.partial(
                tokenizer.backend_tokenizer.decode, skip_special_tokens=True
            )
        elif choice.decode_with == "python_raw":
            self.decode = functools.partial(
                tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        else:
            self.decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        self.clean_up: Callable[[str], str] | None = (
            tokenizer.clean_up_tokenization if choice.clean_up else None
        )

    @property
    def uses_stream(self) -> bool:
        return self.backend is not None

    def detokenizer(self, stop_strings: Iterable[str] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, stop_strings, decoding=self)


@dataclass(frozen=True)
class _Choice:
    """What `_decide` found for a tokenizer; holds no reference to it, so that caching it does
    not keep the tokenizer alive."""

    stream: bool
    decode_with: str  # "backend" (Rust, raw), "python_raw" (no clean-up) or "python" (as is)
    clean_up: bool
    byte_group_open_ids: frozenset[int]
    reason: str  # why the stream decoder is not used ("" when it is)


_choices: weakref.WeakKeyDictionary[Any, _Choice] = weakref.WeakKeyDictionary()


def tokenizer_decoding(tokenizer: Any) -> TokenizerDecoding:
    """The decoding for `tokenizer`, decided on its first use and kept while it lives (a
    tokenizer changed after that, e.g. its clean-up flag, keeps its first decision)."""
    try:
        choice = _choices.get(tokenizer)
    except TypeError:  # neither hashable nor weakly referable: decide every time
        return TokenizerDecoding(tokenizer, _decide(tokenizer))
    if choice is None:
        choice = _choices[tokenizer] = _decide(tokenizer)
    return TokenizerDecoding(tokenizer, choice)


def _decide(tokenizer: Any) -> _Choice:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = isinstance(tokenizer, PreTrainedTokenizerFast) and isinstance(backend, Tokenizer)
    base = PreTrainedTokenizerFast if fast else PreTrainedTokenizer
    cls = type(tokenizer)
    if not isinstance(tokenizer, base) or (
        cls.decode is not base.decode or cls._decode is not base._decode
    ):
        return _Choice(False, "python", False, frozenset(), f"{cls.__name__} decodes its own way")
    open_ids = _byte_group_open_ids(backend) if fast else frozenset()
    as_is = _Choice(False, "python", False, open_ids, "")
    clean_up = _cleans_up(tokenizer, backend if fast else None)
    if clean_up and cls.clean_up_tokenization is not base.clean_up_tokenization:
        reason = f"{cls.__name__} cleans up tokenization spaces its own way"
        return replace(as_is, reason=reason)
    raw = replace(as_is, decode_with="backend" if fast else "python_raw", clean_up=clean_up)
    if not fast:
        reason = "a slow (Python) tokenizer"
    elif clean_up:
        reason = "its decode cleans up tokenization spaces"
    else:
        reason = _decoder_streams_exactly(backend)
        if not reason:
            stream = replace(raw, stream=True)
            if _matches_decode(TokenizerDecoding(tokenizer, stream)):
                return stream
            reason = "its stream decoder's text differed from decode"
    if _matches_decode(TokenizerDecoding(tokenizer, raw)):
        return replace(raw, reason=reason)
    return replace(as_is, reason=reason + "; the windowed raw decode differed from decode")


def _cleans_up(tokenizer: Any, backend: Tokenizer | None) -> bool:
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    # transformers 5 skips the clean-up for BPE models unless this flag forces it.
    force_bpe = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    if backend is not None and hasattr(tokenizer, force_bpe):
        if type(backend.model).__name__ == "BPE" and not getattr(tokenizer, force_bpe):
            return False
    return True


# Decoders whose text for a window of ids is the text of its first ids followed by what the
# others add: each token's text depends on the token alone, on whether it comes first (a
# leading space dropped) or on a byte run (closed before decoding). Replace must act on tokens,
# not on text that Fuse or ByteLevel have joined (a pattern could span two tokens).
_TOKEN_WISE_DECODERS = {"ByteLevel", "Metaspace", "WordPiece", "ByteFallback", "Fuse", "Strip"}


def _decoder_streams_exactly(backend: Tokenizer) -> str:
    """Why the stream decoder may not be exact for `backend`'s decoder ("" when it is)."""
    if backend.decoder is None:
        return ""
    config = json.loads(backend.decoder.__getstate__())
    parts = config["decoders"] if config["type"] == "Sequence" else [config]
    joined = False
    for part in parts:
        kind = part["type"]
        if kind == "Replace" and not joined:
            continue
        if kind not in _TOKEN_WISE_DECODERS or (kind == "Strip" and part["stop"]):
            return f"its decoder ({kind}) is not known to stream exactly"
        joined = joined or kind in ("Fuse", "ByteLevel")
    return ""


def _byte_group_open_ids(backend: Tokenizer) -> frozenset[int]:
    if backend.decoder is None or b"ByteFallback" not in backend.decoder.__getstate__():
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=True)
    byte_ids = {i for t, i in vocab.items() if len(t) == 6 and t[:3] == "<0x" and t[5] == ">"}
    specials = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    return frozenset(byte_ids | specials)


_PROBE_TEXT = (
    "Hello world . It 's fine , isn't it ? Yes ! I 'm sure they 've said we 're ' ok ' "
    "Héllo wörld! 😀🎉 日本語のテキスト, naïve café — ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧\n\tend."
)


def _matches_decode(decoding: TokenizerDecoding) -> bool:
    """Whether streaming a probe (text, special tokens, random and byte tokens, cut at several
    lengths, pushed one at a time and in groups) gives the tokenizer's own decode."""
    try:
        return _probe(decoding)
    except Exception:  # e.g. a decoder that fails on some id: not one to trust
        return False


def _probe(decoding: TokenizerDecoding) -> bool:
    tokenizer = decoding.tokenizer
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    ids = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
    ids += list(tokenizer.all_special_ids)
    ids += [rng.randrange(vocab_size) for _ in range(64)]
    byte_ids = sorted(decoding.byte_group_open_ids)
    ids += [rng.choice(byte_ids) for _ in range(16 if byte_ids else 0)] + ids[:4]
    cuts = sorted({len(ids), *(rng.randrange(1, len(ids)) for _ in range(4))})
    for cut, group in [(cut, 1) for cut in cuts] + [(len(ids), 3)]:
        detokenizer = decoding.detokenizer()
        text = "".join(detokenizer.push(ids[i : i + group]) for i in range(0, cut, group))
        text += detokenizer.finish()
        if detokenizer.uses_stream != decoding.uses_stream:
            return False
        if text != tokenizer.decode(ids[:cut], skip_special_tokens=True):
            return False
    return True
