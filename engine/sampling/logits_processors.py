"""Penalties, biases and min_tokens: the logits processors that run before temperature, top-k
and top-p (in vLLM's order: min_tokens, logit_bias, then repetition, frequency and presence
penalties), on the logits' device, for every row of a batch at once.

A row's penalty state is its token history: the prompt and the tokens generated before the
position it predicts. A plain step predicts after every generated token; a speculative verify
step predicts after the generated tokens plus the first j draft tokens at its position j, which
are exactly the tokens that must be accepted for position j's token to count, so verify sees
the state plain decoding would have had there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import Request
from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """What a row's processors read: the prompt and the tokens generated before the predicted
    position (presence, frequency and min_tokens read the generated ones only)."""

    prompt: Sequence[int]
    generated: Sequence[int]


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """logits [R, V] -> the processed logits, a new tensor when any row asks for processing
    and `logits` itself otherwise (so a batch without penalties costs one test per row).
    `histories[r]` may be None for a row whose params ask for nothing."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    chosen = [params[r] for r in rows]
    chosen_histories = [histories[r] for r in rows]
    assert all(h is not None for h in chosen_histories)
    processed = _process(logits[rows].float(), chosen, chosen_histories, eos_token_ids)  # type: ignore[arg-type]
    out = logits.clone()
    out[rows] = processed.to(logits.dtype)
    return out


def _process(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    _mask_until_min_tokens(logits, params, histories, eos_token_ids)
    _add_logit_bias(logits, params)
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = _counts([list(h.prompt) + list(h.generated) for h in histories], vocab, device) > 0
        penalty = torch.tensor(repetition, dtype=logits.dtype).to(device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    if any(frequency) or any(presence):
        counts = _counts([h.generated for h in histories], vocab, device).to(logits.dtype)
        logits -= torch.tensor(frequency, dtype=logits.dtype).to(device)[:, None] * counts
        present = (counts > 0).to(logits.dtype)
        logits -= torch.tensor(presence, dtype=logits.dtype).to(device)[:, None] * present
    return logits


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] int32 occurrences of each token in each row's list: one padded host-to-device
    copy and one scatter-add for the batch (the pad id V falls in a column cut off after)."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        if tokens:
            padded[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, tokens, biases = [], [], []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias_items:
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if not rows:
        return
    index = torch.tensor([rows, tokens], dtype=torch.int64).to(logits.device)
    values = torch.tensor(biases, dtype=logits.dtype).to(logits.device)
    logits.index_put_((index[0], index[1]), values, accumulate=True)


def _mask_until_min_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory],
    eos_token_ids: Sequence[int],
) -> None:
    rows, tokens = [], []
    for row, (p, history) in enumerate(zip(params, histories)):
        if len(history.generated) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for token in stops:
            if token < logits.shape[1]:
                rows.append(row)
                tokens.append(token)
    if rows:
        index = torch.tensor([rows, tokens], dtype=torch.int64).to(logits.device)
        logits[index[0], index[1]] = -torch.inf


def process_request_logits(
    logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """`process_logits` for a step that predicts each request's next token (row r: requests[r])."""
    histories = [
        TokenHistory(r.prompt_token_ids, r.output_token_ids) if r.params.penalized else None
        for r in requests
    ]
    return process_logits(logits, [r.params for r in requests], histories, eos_token_ids)
