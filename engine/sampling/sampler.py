"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine.executor.host_copy import int_tensor, to_device
from engine.sampling.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # most likely first; empty unless asked for


@dataclass(frozen=True)
class PositionSeed:
    """The seed stream of one output position of a seeded request (engine.sampling.step_sampling):
    the generator that draws it is made only where a draw fills noise from it (on a CPU). A GPU
    needs only one number drawn from it (`derived_seed`), kept per position: a speculative step asks
    again for positions the step before verified and did not commit, and a draft tree for every node
    of a level."""

    key: int

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.key)

    def derived_seed(self) -> int:
        return _seed_of_key(self.key)


# A generator, or where only its position is known so far, that position's seed stream.
SeedSource = torch.Generator | PositionSeed


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[SeedSource | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] (on the CPU): `sample_on_device`, then one copy."""
    return sample_on_device(logits, params, generators, default_generator).cpu()


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[SeedSource | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] on the logits' device, queued without waiting
    for the device (an overlapped step reads them there as the next step's input).

    A sampled row draws by the exponential race: with E_v ~ Exp(1) independent, argmax_v
    p_v / E_v is token v with probability exactly p_v (torch.multinomial draws one sample the
    same way, so on the CPU the tokens are the ones it gives). The sampled rows are filtered
    and drawn together, as one batch."""
    greedy = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy
    probs = filtered_probs_batch(logits[rows], [params[i] for i in rows])
    noise = exponential_noise(probs, [generators[i] or default_generator for i in rows])
    # exponential_ may return 0 in principle: 0 / 0 would be NaN, which argmax picks, so a
    # zero-probability token could come out; clamped, it scores 0 and never wins.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    drawn = probs.div_(noise).argmax(dim=-1)
    if len(rows) == len(params):
        return drawn
    return greedy.index_copy(0, int_tensor(rows, logits.device), drawn)


def exponential_noise(probs: torch.Tensor, generators: list[SeedSource]) -> torch.Tensor:
    """Exp(1) noise shaped like `probs` [R, V], row r drawn from `generators[r]`.

    Generators are host generators. On the CPU each row is filled from its own, as
    torch.multinomial would. A GPU tensor cannot be filled from a host generator, and reseeding
    a device generator row by row costs a launch per row; there a seed drawn from each row's
    generator keys a counter-based hash (`hashed_exponential`) that fills all rows at once, so
    a seeded request still draws the same noise in any batch."""
    if probs.device.type == "cpu":
        noise = torch.empty_like(probs)
        for row, source in zip(noise, generators):
            generator = source.generator() if isinstance(source, PositionSeed) else source
            row.exponential_(generator=generator)
        return noise
    seeds = int_tensor(noise_seeds(generators), probs.device)
    return hashed_exponential(seeds, probs.shape[1]).to(probs.dtype)


def noise_seeds(generators: list[SeedSource]) -> list[int]:
    """The seed of each row's noise on a GPU: a number drawn from the row's generator."""
    return [
        source.derived_seed() if isinstance(source, PositionSeed) else _derived_seed(source)
        for source in generators
    ]


# splitmix64's constants, as the signed 64-bit integers torch computes with.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch shifts signed integers arithmetically; the mask makes it a logical shift.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = z.clone()
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shift_right(z, 31))


def hashed_exponential(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R] int64 seeds -> [R, vocab] float32 Exp(1) draws: entry (r, v) is a function of
    (seeds[r], v) alone (splitmix64 of the seed's stream at v), the same on every device."""
    index = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    z = _splitmix64(_splitmix64(seeds)[:, None] + index * _GOLDEN)
    # The top 53 bits, centred in their interval: a uniform in (0, 1), never 0 or 1.
    uniform = (_shift_right(z, 11).double() + 0.5) * 2.0**-53
    return uniform.log_().neg_().float()


def _derived_seed(generator: torch.Generator) -> int:
    return int(torch.randint(2**63 - 1, (), generator=generator, dtype=torch.int64))


@functools.lru_cache(maxsize=1 << 16)
def _seed_of_key(key: int) -> int:
    """`_derived_seed` of a fresh generator seeded with `key`: always the same number, so it
    is drawn once (making and seeding a generator costs the host microseconds a row)."""
    return _derived_seed(torch.Generator().manual_seed(key))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws a non-greedy token from: one logits row [V] -> probs [V].
    Speculative acceptance tests draft tokens against exactly this distribution."""
    return filtered_probs_batch(logits[None], [params])[0]


def filtered_probs_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`filtered_probs` of every row of logits [R, V], row r under params[r], in one pass: a
    launch per operation for the batch, not one per request."""
    rows, vocab = logits.shape
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / to_device(temperatures, logits.device)[:, None], dim=-1)
    filtering = [r for r, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if not filtering:
        return probs
    chosen = probs if len(filtering) == rows else probs[filtering]
    sorted_probs, order = chosen.sort(dim=-1, descending=True)
    # top_k 0 keeps every rank; top_p 1 keeps every prefix (the mass before a token may round
    # to 1 or above, so the test is switched off for those rows rather than run against 1).
    top_k = torch.tensor([params[r].top_k or vocab for r in filtering])
    top_p = torch.tensor(
        [params[r].top_p if params[r].top_p < 1.0 else math.inf for r in filtering]
    )
    ranks = torch.arange(vocab, device=logits.device)
    keep = ranks[None, :] < to_device(top_k, logits.device)[:, None]
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it
    # is still below top_p, so the first token always stays.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep &= mass_before < to_device(top_p, logits.device).to(mass_before.dtype)[:, None]
    # Back in vocabulary order by a scatter rather than boolean indexing, whose data-dependent
    # size would make a GPU wait for the host.
    kept = torch.empty_like(keep).scatter_(-1, order, keep)
    filtered = chosen.masked_fill(~kept, 0.0)
    filtered = filtered / filtered.sum(-1, keepdim=True)
    if len(filtering) == rows:
        return filtered
    probs[filtering] = filtered
    return probs


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
