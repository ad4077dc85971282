"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # most likely first; empty unless asked for


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] (on the CPU)."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).cpu()
    tokens = logits.argmax(dim=-1).cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered_probs(logits[i], p).cpu()
        generator = generators[i] or default_generator
        tokens[i] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws a non-greedy token from: one logits row [V] -> probs [V].
    Speculative acceptance tests draft tokens against exactly this distribution."""
    return _filtered_probs(logits, params)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_k == 0 and p.top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it
        # is still below top_p, so the first token always stays.
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < p.top_p
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered / filtered.sum()


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprob | None]:
    """Log-probabilities of the chosen tokens under the model's raw distribution."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not wanted:
        return result
    logprobs = torch.log_softmax(logits[wanted], dim=-1).cpu()
    for row, i in enumerate(wanted):
        token = int(tokens[i])
        top: list[tuple[int, float]] = []
        n = params[i].logprobs
        if n:
            values, ids = logprobs[row].topk(n)
            top = [(int(t), float(v)) for t, v in zip(ids, values)]
        result[i] = TokenLogprob(token, float(logprobs[row, token]), top)
    return result
