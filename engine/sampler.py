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
    """logits [B, V] float32 -> token ids [B] (on the CPU).

    A sampled row draws by the exponential race: with E_v ~ Exp(1) independent, argmax_v
    p_v / E_v is token v with probability exactly p_v (torch.multinomial draws one sample the
    same way, so on the CPU the tokens are the ones it gives). Everything stays on the logits'
    device until one copy brings the whole batch back, so a GPU never waits on the host for a
    single request's draw."""
    greedy = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy.cpu()
    probs = torch.stack([_filtered_probs(logits[i], params[i]) for i in rows])
    noise = torch.empty_like(probs)
    for row, i in zip(noise, rows):
        generator = generators[i] or default_generator
        if generator.device != row.device:
            # Generators are host generators, and a GPU tensor can only be filled from one of
            # its own device. A seed drawn from the request's generator keys a device one, so a
            # seeded request still draws the same noise in any batch.
            device_generator = _device_generator(row.device)
            device_generator.manual_seed(_derived_seed(generator))
            generator = device_generator
        row.exponential_(generator=generator)
    # exponential_ may return 0 in principle: 0 / 0 would be NaN, which argmax picks, so a
    # zero-probability token could come out; clamped, it scores 0 and never wins.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    drawn = probs.div_(noise).argmax(dim=-1)
    both = torch.cat([greedy, drawn]).cpu()
    tokens = both[: len(params)].clone()
    tokens[rows] = both[len(params) :]
    return tokens


_device_generators: dict[torch.device, torch.Generator] = {}


def _device_generator(device: torch.device) -> torch.Generator:
    """One generator per device, made once: it is reseeded before every draw."""
    generator = _device_generators.get(device)
    if generator is None:
        generator = _device_generators[device] = torch.Generator(device=device)
    return generator


def _derived_seed(generator: torch.Generator) -> int:
    return int(torch.randint(2**63 - 1, (), generator=generator, dtype=torch.int64))


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
    # Back in vocabulary order by a scatter rather than boolean indexing, whose data-dependent
    # size would make a GPU wait for the host.
    kept = torch.empty_like(keep).scatter_(0, order, keep)
    filtered = probs.masked_fill(~kept, 0.0)
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
