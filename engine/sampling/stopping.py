"""Decide when a request is done, and the text it returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.request import Request
from engine.sampling.sampler import TokenLogprob

# Decoding a few extra tokens before a stop string's possible start covers tokens that
# produce no full character on their own (byte fallback).
_STOP_WINDOW_SLACK = 4


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, req: Request) -> str | None:
        """Finish reason after the request's newest token, or None to go on."""
        params = req.params
        last = req.output_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return "stop"
        if last in self.eos_token_ids and req.grammar is not None and req.grammar.finished:
            # Under ignore_eos too: a grammar that has ended allows end-of-sequence only, so
            # going on would pad the answer with it up to max_tokens.
            return "stop"
        if params.stop:  # non-empty when given (validated): no tuple made for most requests
            # A character can take up to one token per UTF-8 byte.
            window = max(len(s.encode()) for s in params.stop_strings) + _STOP_WINDOW_SLACK
            tail = self.tokenizer.decode(req.output_token_ids[-window:], skip_special_tokens=True)
            for stop in params.stop_strings:
                if stop in tail:
                    req.stopped_by_string = stop
                    return "stop"
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def commit(
        self,
        req: Request,
        tokens: list[int],
        logprobs: Sequence[TokenLogprob | None] = (),
    ) -> str | None:
        """Commit `tokens` in order with their `logprobs` (one per token where given, None for
        none), `check`ing after each and stopping at the first that finishes `req`; returns the
        finish reason (None to go on). A verify step commits several tokens; those after a stop
        are dropped."""
        for i, token in enumerate(tokens):
            req.commit(token)
            if i < len(logprobs) and logprobs[i] is not None:
                req.logprobs.append(logprobs[i])
            reason = self.check(req)
            if reason is not None:
                return reason
        return None

    def final_text(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if req.stopped_by_string is not None:
            # The stop string itself is not part of the answer, as in the OpenAI API.
            cut = min(
                (i for s in req.params.stop_strings if (i := text.find(s)) >= 0), default=len(text)
            )
            text = text[:cut]
        return text
