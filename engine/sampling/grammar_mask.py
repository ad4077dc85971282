"""Grammar masks on the logits' device: one int32 bitmask [rows, words] filled on the host by
each row's matcher (engine.sampling.grammar), one copy to the device, and the logits of every token
it forbids set to -inf there, for the whole batch at once.

The grammar wins over min_tokens. A grammar that is complete allows end-of-sequence only, which
min_tokens (or a stop token it also bans) may still forbid: every token of that row would be
-inf, and sampling would draw garbage (NaN probabilities; argmax picks token 0) that the
grammar forbids. The grammar is the answer's validity and min_tokens only a length hint, and
whether a grammar completes before min_tokens is not known when a request arrives, so refusing
the combination would refuse requests that are fine; instead a row left with no token is
masked again from its logits before the processors, so a complete grammar ends the answer
early (vLLM and SGLang users get an answer that parses, not one padded past its end). Where the
grammar allows other tokens too, min_tokens still holds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.sampling.grammar import GrammarMatcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Every token allowed: rows without a grammar keep this."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


# Bit i of an int32 word (bit 31 is the sign bit). A bitwise and with these costs a third less
# than shifting each word 32 ways on a CPU.
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, unprocessed: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [R, V] with every token whose bit is clear in bitmask [R, words] (host) set to
    -inf: a new tensor, since the raw logits still give the model's own logprobs.
    `unprocessed`: the same logits before the logits processors; a row that the mask leaves
    with no token (min_tokens banned every token the grammar allows) is masked from it
    instead (the grammar wins; see the module's docstring). On the device, no host sync."""
    rows, vocab = logits.shape
    words = bitmask.to(logits.device, non_blocking=True)
    bits = _BITS.to(logits.device, non_blocking=True)
    allowed = (words[:, :, None] & bits).ne(0).view(rows, -1)[:, :vocab]
    masked = logits.masked_fill(~allowed, -torch.inf)
    if unprocessed is None or unprocessed is logits:
        return masked
    no_token_left = torch.isneginf(masked).all(dim=-1, keepdim=True)
    return torch.where(no_token_left, unprocessed.masked_fill(~allowed, -torch.inf), masked)


def mask_request_logits(
    logits: torch.Tensor, requests: Sequence[Request], unprocessed: torch.Tensor | None = None
) -> torch.Tensor:
    """A step that predicts each request's next token (row r: requests[r]): the grammar's
    mask where the request has one, `logits` itself when none does. `unprocessed`: as in
    `apply_bitmask`."""
    matchers = [req.grammar for req in requests]
    if all(m is None for m in matchers):
        return logits
    bitmask = new_bitmask(len(requests), logits.shape[1])
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill(bitmask[row])
    return apply_bitmask(logits, bitmask, unprocessed)


def mask_verify_logits(
    logits: torch.Tensor,
    matchers: Sequence[GrammarMatcher | None],
    spans: Sequence[tuple[Sequence[int], int]],
    unprocessed: torch.Tensor | None = None,
) -> torch.Tensor:
    """A verify forward's logits [T, V], the spans in row order: span i (matchers[i]'s
    request; drafts, first) holds the positions after drafts[:first], ..., drafts[:len], each
    masked with the grammar state after that prefix of drafts. `unprocessed`: as in
    `apply_bitmask`, so that verify masks each position as plain decoding would."""
    if all(m is None for m in matchers):
        return logits
    bitmask = new_bitmask(logits.shape[0], logits.shape[1])
    start = 0
    for matcher, (drafts, first) in zip(matchers, spans):
        count = len(drafts) + 1 - first
        if matcher is not None:
            matcher.fill_after_prefixes(drafts, first, bitmask[start : start + count])
        start += count
    assert start == logits.shape[0], "one row per verified position"
    return apply_bitmask(logits, bitmask, unprocessed)
