"""The verify forward's logits as plain decoding would see them at each position (penalties
and grammars along the drafts before it), and a verify's `Verdict`. Acceptance follows the
target's own choices down the drafts (spec.tree.accept_tree, chains included): each committed
token is the target's argmax or draw at its position, so speculation changes speed, never the
output distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.grammar_mask import mask_verify_logits
from engine.logits_processors import TokenHistory, process_logits
from engine.request import Request
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # spec.tree builds on this module's Verdict
    from spec.tree import DraftTree


@dataclass
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the target's bonus token
    num_accepted: int


def processed_verify_logits(
    logits: torch.Tensor,
    requests: list[Request],
    trees: list[DraftTree],
    eos_token_ids: tuple[int, ...],
) -> torch.Tensor:
    """The verify forward's logits [T, V] after each request's logits processors, in the
    forward's row order (each request's newest token, then its tree's nodes). Each row sees the
    penalty state after the drafts before it (`DraftTree.row_drafts`: for a chain its first
    drafts, in a tree the path down to the row's node), the ones that must be accepted before
    it: what plain decoding would see there, so acceptance stays lossless."""
    if not any(req.params.penalized for req in requests):
        return logits
    params: list[SamplingParams] = []
    histories: list[TokenHistory | None] = []
    for req, tree in zip(requests, trees):
        for drafts in tree.row_drafts():
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
