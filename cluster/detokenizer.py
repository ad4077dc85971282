"""Turn a stream of token ids into a stream of text that is always safe to show."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with `push`, get back only new, complete text; `finish` flushes the rest.

    The concatenation of every push and the finish equals
    `tokenizer.decode(all_ids, skip_special_tokens=True)` cut before the first stop string.

    Decoding token by token is wrong in two ways: a multi-byte character split over tokens
    decodes to U+FFFD until its last byte arrives, and tokenizers that strip a word's leading
    space at the start of a decode would lose spaces. So each push decodes a window that starts
    one emitted chunk back (`prefix_offset`) and emits only what the window adds past the text
    already emitted (`read_offset`), holding back while the window ends in U+FFFD.

    With stop strings, the last (longest stop string - 1) characters are also held back, so a
    stop string split over tokens is never shown; once one appears, later tokens are ignored.
    """

    def __init__(self, tokenizer: Any, stop_strings: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all complete text decoded so far
        self._emitted = 0  # how many characters of _text were returned
        self._stop_at: int | None = None  # where the first stop string starts in _text
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string appeared: the text is final and further tokens are ignored."""
        return self._stop_at is not None

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._emitted]

    def push(self, token_ids: Iterable[int]) -> str:
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._token_ids))
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            self._text += window[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush the held-back text (an incomplete character at the very end shows as U+FFFD,
        as in a full decode)."""
        if self._finished:
            return ""
        self._finished = True
        if not self.stopped:
            prefix = self._decode(self._prefix_offset, self._read_offset)
            window = self._decode(self._prefix_offset, len(self._token_ids))
            self._text += window[len(prefix) :]
            self._read_offset = len(self._token_ids)
        return self._release(final=True)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self._token_ids[start:end], skip_special_tokens=True)

    def _release(self, final: bool) -> str:
        if self.stop_strings and not self.stopped:
            self._stop_at = self._find_stop()
        if self._stop_at is not None:
            end = self._stop_at
        elif final:
            end = len(self._text)
        else:
            end = max(self._emitted, len(self._text) - self._hold)
        new = self._text[self._emitted : end]
        self._emitted = end
        return new

    def _find_stop(self) -> int | None:
        # An occurrence cannot lie wholly in the emitted text (it would have been found when
        # that text arrived), so the search starts one stop-string length before the new text.
        start = max(0, self._emitted - self._hold)
        hits = [i for s in self.stop_strings if (i := self._text.find(s, start)) >= 0]
        return min(hits, default=None)
