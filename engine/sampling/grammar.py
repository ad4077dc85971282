"""Structured output: a grammar that constrains a request's tokens (llguidance).

A request carries its grammar as text (`SamplingParams.grammar`, llguidance's grammar format:
plain data, so it crosses to prefill and decode nodes as a string); each engine compiles it
for its tokenizer into a `GrammarMatcher`, the request's parser state. The matcher advances on
every committed token (`Request.commit`), and each step that predicts a token masks the logits
with the tokens the grammar allows next: a bitmask filled on the host and applied on the
logits' device (`engine.sampling.grammar_mask`).

Compilation runs on a background thread and is cached per grammar text (an LRU), so a new
schema compiles beside the running batch instead of stalling it, and a schema seen before
starts from a copy of the compiled matcher. llguidance is optional (the `structured` extra):
without it a request that asks for a grammar is rejected, naming the field."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.errors import RequestRejectedError

try:
    import llguidance
    import llguidance.hf
except ImportError:  # the `structured` extra is not installed
    llguidance = None

GRAMMAR_CACHE_SIZE = 64
# JSON without free whitespace: a small model allowed any amount of it may pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_library_available() -> bool:
    return llguidance is not None


def require_grammar_library(param: str) -> None:
    if llguidance is None:
        raise RequestRejectedError(
            f"{param} needs structured output, which needs the llguidance package "
            "(install pdcluster[structured])",
            param=param,
        )


def json_schema_grammar(schema: dict[str, Any] | None, param: str) -> str:
    """The grammar of JSON text valid under `schema`; None: any JSON object (OpenAI's
    json_object). Refused with the field named when the schema cannot be compiled."""
    require_grammar_library(param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, overrides=JSON_OPTIONS
        )
    except (ValueError, TypeError) as err:
        raise RequestRejectedError(f"{param}: not a usable JSON schema: {err}", param) from err
    check_grammar(grammar, param)
    return grammar


def check_grammar(grammar: str, param: str) -> None:
    """Refuse a grammar that will not compile (cheap: no tokenizer involved)."""
    require_grammar_library(param)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise RequestRejectedError(f"{param}: the grammar does not compile: {problem}", param)


class GrammarCompileError(RuntimeError):
    pass


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary. `start` never blocks: it hands
    back a matcher whose compiled grammar arrives from the background thread."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], capacity: int = 64
    ) -> None:
        require_grammar_library("grammar")
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.capacity = capacity
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def start(self, grammar: str) -> GrammarMatcher:
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is None:
                compiled = self._pool.submit(self._compile, grammar)
                self._cache[grammar] = compiled
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(grammar)
        return GrammarMatcher(compiled, self.eos_token_ids)

    def cached(self, grammar: str) -> bool:
        with self._lock:
            return grammar in self._cache

    def _compile(self, grammar: str) -> Any:
        if self._tokenizer is None:
            # About a second for a large vocabulary, so built once, off the caller's thread.
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error())
        return matcher


class GrammarMatcher:
    """One request's grammar state: the tokens committed so far, consumed by its own copy of
    the compiled grammar."""

    def __init__(self, compiled: Future, eos_token_ids: Sequence[int]) -> None:
        self._compiled = compiled
        self._eos_token_ids = list(eos_token_ids)
        self._matcher: Any = None

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    def wait(self, timeout: float) -> None:
        try:
            self._compiled.exception(timeout)
        except TimeoutError:
            pass

    @property
    def error(self) -> str | None:
        """Why the grammar failed to compile (None while compiling or once compiled)."""
        if not self.ready:
            return None
        err = self._compiled.exception()
        return None if err is None else f"grammar failed to compile: {err}"

    def _state(self) -> Any:
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()
        return self._matcher

    def advance(self, token: int) -> None:
        """Consume a committed token. A token the grammar forbids (only one that no mask
        screened, such as a stop forced past the grammar's end) leaves the matcher in its
        error state, whose mask allows end-of-sequence only."""
        self._state().consume_token(token)

    @property
    def finished(self) -> bool:
        return self._state().is_stopped()

    def fill(self, row: torch.Tensor) -> None:
        """The tokens allowed next, as bits of `row` (int32 [words], contiguous, CPU)."""
        matcher = self._state()
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if not bool(row.any()):
            self._allow_eos_only(row)

    def fill_after_prefixes(self, drafts: Sequence[int], first: int, rows: torch.Tensor) -> None:
        """rows[i]: the tokens allowed after drafts[:first + i] (a verify step's positions),
        the drafts consumed tentatively and rolled back. Past the first draft the grammar
        forbids, rows repeat the last allowed set: that draft is rejected, so nothing after
        it is ever sampled."""
        matcher = self._state()
        valid = matcher.validate_tokens(list(drafts))
        consumed = 0
        for i in range(rows.shape[0]):
            end = min(first + i, valid)
            if end > consumed:
                matcher.consume_tokens(list(drafts[consumed:end]))
                consumed = end
            if first + i > valid and i:
                rows[i].copy_(rows[i - 1])
            else:
                self.fill(rows[i])
        if consumed:
            matcher.rollback(consumed)

    def _allow_eos_only(self, row: torch.Tensor) -> None:
        for token in self._eos_token_ids:
            word, bit = divmod(token, 32)
            if word < row.numel():
                # int32 words: bit 31 is the sign bit.
                row[word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
