"""The sampling step of every node that samples after a forward: each request's next token
from its last-position logits, with its processors, grammar mask and seed stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.request import Request
from engine.sampling.grammar_mask import mask_request_logits
from engine.sampling.logits_processors import process_request_logits
from engine.sampling.sampler import (
    PositionSeed,
    TokenLogprob,
    compute_logprobs,
    sample,
    sample_on_device,
)

if TYPE_CHECKING:
    from engine.executor.model_runner import ForwardOutput, ModelRunner


def position_seed(seed: int, index: int) -> PositionSeed:
    """The seed stream that draws output token number `index` of a request seeded with `seed`
    (a generator seeded with a key of the two)."""
    return PositionSeed((seed * 0x9E3779B97F4A7C15 + index) % (2**63))


def step_seed(req: Request, in_flight: int = 0) -> PositionSeed | None:
    """A seeded request draws each token from the seed stream of (seed, token index)
    (`position_seed`), so the same seed gives the same tokens whichever node or batch samples
    a given position.
    `in_flight`: tokens sampled before this one that are not committed yet (overlap)."""
    if req.params.seed is None:
        return None
    return position_seed(req.params.seed, len(req.output_token_ids) + in_flight)


def sample_next_tokens(
    logits: torch.Tensor,
    requests: list[Request],
    eos_token_ids: Sequence[int],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
    """Each request's next token from its last-position logits [B, vocab] (penalties, biases
    and min_tokens first, then the grammar's mask, which wins where min_tokens leaves it no
    token, then its sampling settings), and its logprob entry. The one sampling step of every
    node that samples after a forward."""
    params = [req.params for req in requests]
    generators = [step_seed(req) for req in requests]
    processed = process_request_logits(logits, requests, eos_token_ids)
    processed = mask_request_logits(processed, requests, unprocessed=logits)
    tokens = sample(processed, params, generators, default_generator)
    return tokens, compute_logprobs(logits, tokens, params)


def decode_plainly(
    runner: ModelRunner,
    requests: list[Request],
    eos_token_ids: Sequence[int],
    default_generator: torch.Generator,
    keep_hidden: bool = False,
) -> tuple[ForwardOutput, list[int], list[TokenLogprob | None]]:
    """A plain decode step's forward and sampling: one new token a request, its logprob entry,
    and the forward's output (with the hidden states at the newest tokens, `keep_hidden`).
    The one plain decode step of an engine, speculating or not."""
    output = runner.forward(runner.build_batch(requests), keep_hidden=keep_hidden)
    tokens, logprobs = sample_next_tokens(output.logits, requests, eos_token_ids, default_generator)
    return output, tokens.tolist(), logprobs


def samples_from_logits_alone(req: Request) -> bool:
    """Whether `req`'s next token depends on nothing but its logits and its seed stream: no
    penalty, bias or min_tokens (they read the token history), no grammar (its mask needs the
    newest token) and no logprobs (read on the host). Such tokens can be drawn, and a
    speculative round decided, on the device before the host has seen the step before."""
    params = req.params
    return req.grammar is None and params.logprobs is None and not params.penalized


def sample_overlapped(
    logits: torch.Tensor,
    requests: list[Request],
    in_flight: list[int],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """The next tokens of requests that sample from their logits alone (engine.executor.overlap),
    left on the device; request i has `in_flight[i]` tokens sampled and not committed yet."""
    params = [req.params for req in requests]
    generators = [step_seed(req, ahead) for req, ahead in zip(requests, in_flight)]
    return sample_on_device(logits, params, generators, default_generator)
