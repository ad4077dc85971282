"""Acceptance rules of verify: which draft tokens the target keeps, and the token it adds.

The draft proposes a chain greedily (its argmax at each depth), so its proposal distribution q
is one-hot on the draft token. Speculative sampling then accepts draft token x with probability
min(1, p(x) / q(x)) = p(x), and on rejection samples from normalize(max(0, p - q)): p with x's
mass removed. Either way the committed token is distributed exactly as p, the target's own
(temperature/top-k/top-p filtered) distribution, so speculation changes speed, never output
distribution. Greedy requests accept a draft token iff it is the target's argmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar_mask import mask_verify_logits
from engine.logits_processors import TokenHistory, process_logits
from engine.request import Request
from engine.sampler import filtered_probs_batch
from engine.sampling_params import SamplingParams


@dataclass
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the target's bonus token
    num_accepted: int


def processed_verify_logits(
    logits: torch.Tensor,
    requests: list[Request],
    row_drafts: list[list[list[int]]],
    eos_token_ids: tuple[int, ...],
) -> torch.Tensor:
    """The verify forward's logits [T, V] after each request's logits processors, in the
    forward's row order; row_drafts[i][r]: the drafts before request i's row r (for a chain,
    its first r drafts; in a tree, the path down to the row's node). Each row sees the penalty
    state after those drafts, the ones that must be accepted before it: what plain decoding
    would see there, so acceptance stays lossless."""
    if not any(req.params.penalized for req in requests):
        return logits
    params: list[SamplingParams] = []
    histories: list[TokenHistory | None] = []
    for req, rows in zip(requests, row_drafts):
        for drafts in rows:
            params.append(req.params)
            penalized = req.params.penalized
            generated = req.output_token_ids + drafts if penalized else []
            histories.append(TokenHistory(req.prompt_token_ids, generated) if penalized else None)
    assert len(params) == logits.shape[0]
    return process_logits(logits, params, histories, eos_token_ids)


def grammar_masked_verify_logits(
    logits: torch.Tensor,
    requests: list[Request],
    chains: list[list[int]],
    unprocessed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The verify logits [T, V] (rows as in `processed_verify_logits`) with each position
    masked by its request's grammar in the state after the drafts before it: a draft token the
    grammar forbids has probability 0 where it is checked, so it is rejected, never emitted,
    and the bonus token is one the grammar allows. Requests under a grammar verify chains;
    `chains[i]` holds one token per row after the first for the others. `unprocessed`: the
    logits before the processors, where a position's grammar wins over min_tokens
    (engine.grammar_mask)."""
    if all(req.grammar is None for req in requests):
        return logits
    matchers = [req.grammar for req in requests]
    return mask_verify_logits(logits, matchers, [(chain, 0) for chain in chains], unprocessed)


def accept_chain(
    logits: torch.Tensor,
    draft_ids: list[int],
    params: SamplingParams,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> Verdict:
    """logits [k+1, V]: the target's at the newest committed token and at each of the k draft
    tokens. generators[j] draws output token j of this step (None: the default generator)."""
    if params.greedy:
        return accept_greedy(logits.argmax(dim=-1).tolist(), draft_ids)
    return accept_sampled(logits, draft_ids, params, generators, default_generator)


def accept_greedy(target_ids: list[int], draft_ids: list[int]) -> Verdict:
    """target_ids [k+1]: the target's argmax at the newest token and at each draft token."""
    assert len(target_ids) == len(draft_ids) + 1
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return Verdict(draft_ids[:accepted] + [target_ids[accepted]], accepted)


def accept_sampled(
    logits: torch.Tensor,
    draft_ids: list[int],
    params: SamplingParams,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> Verdict:
    k = len(draft_ids)
    assert logits.shape[0] == k + 1 and len(generators) == k + 1
    tokens: list[int] = []
    # Every position's distribution in one copy to the host: the walk below reads them one by
    # one, and a copy per position would wait for the device each time.
    all_probs = filtered_probs_batch(logits, [params] * (k + 1)).cpu()
    for j in range(k + 1):
        probs = all_probs[j]
        generator = generators[j] or default_generator
        if j == k:  # every draft accepted: the bonus token comes from the last position
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
            break
        draft = draft_ids[j]
        if float(torch.rand((), generator=generator)) < float(probs[draft]):
            tokens.append(draft)
            continue
        residual = probs.clone()
        residual[draft] = 0.0
        # p(draft) < 1 here (a uniform draw in [0, 1) fell at or above it), so mass remains.
        tokens.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]))
        break
    return Verdict(tokens, len(tokens) - 1)
