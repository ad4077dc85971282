"""Acceptance: which of a verify's drafts the target keeps, and the verify logits it decides
on.

One rule, `accept`, for chains and trees alike (a chain is the tree whose node i's parent is
node i - 1): from the root, step to the first child (in node order) whose token is the
target's choice at the current span row, while there is one; the committed tokens are the
target's choices along that path, the last at the row where the walk stopped. A greedy
request's choice is the target's argmax, a sampled one's its own draw
(spec.runtime.tree_verify.target_draws): each committed token is the target's own choice at its
position, so speculation changes speed, never the output distribution. A node's children are
tried at once, so a tree accepts a child with probability p(c1) + p(c2) + ..., the most any
rule can, and seeded requests commit what plain decoding would, whatever the tree or batch.

Every path decides with it: the host's round (`accept_on_host`), rounds of chains on the
device and the verify graphs of chains in their replay (`chain_verdicts`), rounds of trees on
the device (spec/runtime/tree_round.py), where a GPU runs the Triton kernel
engine/kernels/tree_accept.py instead: the same function, tested against `accept`. Before it,
the verify's logits are made what plain decoding would see at each position (penalties and
grammars in the state after the drafts before it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.request import Request
from engine.sampling.grammar_mask import mask_verify_logits
from engine.sampling.logits_processors import TokenHistory, process_logits
from engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:  # spec.runtime.tree builds on this module
    from spec.runtime.tree import DraftTree


@dataclass
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the target's bonus token
    num_accepted: int
    path: list[int] = field(default_factory=list)  # the accepted nodes, level 1 first


def accept(
    targets: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule over n trees of N nodes each, all on one device: `targets` [n, N+1]
    the target's choice at each span row (row 0 the root, row i + 1 node i), `tokens` and
    `parents` [n, N] (parents before their children, -1: the root; a padding node's parent is
    -2, so that it is no row's child), `depth` at least the deepest tree's levels. Returns
    each tree's accepted count [n] and the span row of each committed position [n, depth+1]
    (0: the root, then the accepted node of each level; 0 past the accepted ones): the
    committed tokens are `targets.gather(1, path)`'s first count + 1. A fixed number of
    tensor operations, no read on the host: it runs inside a CUDA graph's replay."""
    n = tokens.shape[0]
    parent_rows = parents + 1
    matches = tokens == targets.gather(1, parent_rows.clamp_min(0))
    row = torch.zeros((n, 1), dtype=torch.int64, device=tokens.device)
    rows = [row]
    for _ in range(depth):
        # The first child of `row` that matches; where none does, the walk stays (and stays
        # for good, as the same row finds the same nothing).
        found, first = ((parent_rows == row) & matches).max(dim=1, keepdim=True)
        row = torch.where(found, first + 1, row)
        rows.append(row)
    walked = torch.cat(rows, dim=1)  # a child's row is above its parent's
    accepted = (walked[:, 1:] > walked[:, :-1]).sum(dim=1)
    positions = torch.arange(depth + 1, device=tokens.device)
    return accepted, torch.where(positions <= accepted[:, None], walked, 0)


def chain_verdicts(logits: torch.Tensor, input_ids: torch.Tensor, width: int) -> torch.Tensor:
    """`accept` for the first n = T // width spans of `width` tokens each (the newest token
    then a chain of width - 1 drafts), with the target's argmax of `logits` [T, vocab]:
    [n, width + 1], the argmax at each token, then the accepted count. The argmax past the
    accepted drafts is kept as it is (the draft extend reads the block whole). On a chain the
walk of `accept` is the longest prefix of drafts equal to the argmax before each, which one
cumulative product counts: a few kernels in a verify graph's replay where the walk takes
several per level (tests/test_spec_acceptance.py holds the two equal)."""
    n = logits.shape[0] // width
    used = n * width
    targets = logits[:used].argmax(dim=-1).view(n, width)
    drafts = input_ids[:used].view(n, width)[:, 1:]
    accepted = (targets[:, :-1] == drafts).long().cumprod(dim=1).sum(dim=1)
    return torch.cat([targets, accepted[:, None]], dim=1)


def accept_on_host(trees: list[DraftTree], targets: list[list[int]]) -> list[Verdict]:
    """`accept` for trees of any sizes, `targets[i]` the target's choices at tree i's span
    rows: the trees padded to the largest (-2, no token or row), decided in one call."""
    width = max((len(tree) for tree in trees), default=0)
    flat: list[int] = []  # per tree: its tokens, parents and targets, each padded
    for tree, chosen in zip(trees, targets):
        padding = [-2] * (width - len(tree))
        flat += tree.tokens + padding + tree.parents + padding + chosen + padding
    # numpy reads a list of ints several times faster than torch.tensor does.
    columns = torch.from_numpy(np.array(flat, dtype=np.int64)).view(len(trees), 3 * width + 1)
    tokens, parents, rows = columns.split([width, width, width + 1], dim=1)
    depth = max((tree.depth for tree in trees), default=0)
    accepted, path = accept(rows, tokens, parents, depth)
    verdicts = []
    for tree, chosen, decided in zip(
        trees, targets, torch.cat([accepted[:, None], path], 1).tolist()
    ):
        count, span_rows = decided[0], decided[1:]
        kept = [r - 1 for r in span_rows[1 : count + 1]]
        tokens_out = [tree.tokens[node] for node in kept] + [chosen[span_rows[count]]]
        verdicts.append(Verdict(tokens_out, count, kept))
    return verdicts


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
    (engine.sampling.grammar_mask)."""
    if all(req.grammar is None for req in requests):
        return logits
    matchers = [req.grammar for req in requests]
    return mask_verify_logits(logits, matchers, [(chain, 0) for chain in chains], unprocessed)
