"""Decide when a request is done, and the text it returns."""

from __future__ import annotations

from typing import Any

from engine.request import Request

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

    def commit(self, req: Request, tokens: list[int]) -> str | None:
        """Commit `tokens` in order, stopping at the first that finishes `req`; returns the
        finish reason (None to go on). The tokens `check` would let pass are the same: for a
        request with no grammar and no stop string, whose stop conditions read only the token
        itself and the output's length, without a call per token (a speculative round commits
        several tokens for each of its requests)."""
        params = req.params
        if req.grammar is not None or params.stop:
            for token in tokens:
                req.commit(token)
                reason = self.check(req)
                if reason is not None:
                    return reason
            return None
        out = req.output_token_ids
        # The tokens that fit before max_tokens or the model's length ends the request.
        room = min(params.max_tokens - len(out), self.max_model_len - req.num_tokens)
        eos = () if params.ignore_eos else self.eos_token_ids
        stop_ids = params.stop_token_ids
        for i, token in enumerate(tokens):
            if token in eos or token in stop_ids:
                out += tokens[: i + 1]
                return "stop"
            if i + 1 >= room:
                out += tokens[: i + 1]
                return "length"
        out += tokens
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
