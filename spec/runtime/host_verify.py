"""The host's round of a decode step: one target forward over each request's newest token and
its drafts (a chain, or a tree whose nodes see their ancestors only), then acceptance on the
host, for what the device round (spec/runtime/device_round.py) does not decide: sampled requests,
logits processing, grammars, logprobs, trees."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.executor.host_copy import int_tensor
from engine.executor.model_runner import ModelRunner
from engine.request import Request
from engine.sampling.sampler import TokenLogprob, compute_logprobs
from spec.runtime.acceptance import (
    accept_on_host,
    grammar_masked_verify_logits,
    processed_verify_logits,
)
from spec.runtime.batching import Span, extend_batch
from spec.runtime.device_round import DeviceRound
from spec.runtime.tree import DraftTree
from spec.runtime.tree_verify import TreeSlots, target_draws


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per request: the tokens to commit
    logprobs: list[list[TokenLogprob | None]] | None  # None: no token has one
    num_accepted: list[int]  # per request: draft tokens it accepted
    num_drafts: list[int]  # per request: draft positions checked (0: no speculation this step)
    num_proposed: list[int]  # per request: draft tokens checked, every node of its tree
    hidden: list[torch.Tensor]  # per request: the target's at the newest token and kept path
    num_outputs_before: list[int]
    # Set when the round ran on the device (spec.runtime.device_round): the draft extend already
    # ran.
    extended: DeviceRound | None = None


def verify_on_host(
    runner: ModelRunner,
    requests: list[Request],
    trees: list[DraftTree],
    spans: list[Span],
    taken: TreeSlots,
    default_generator: torch.Generator,
    kept_width: int | None = None,
) -> VerifyResult:
    """Verify `spans` (each request's newest token then its tree's nodes, `taken` holding the
    slots of nodes past the request's own) and accept on the host: a greedy request follows
    the target's argmax, a sampled one the target's own draws. A request that keeps a tree's
    branch takes over the slots of its nodes (TreeSlots.keep_path). A tree's kept hidden states
    are those of its newest token and kept path, padded to `kept_width` rows (the fixed-shape
    extend's K+1) with its newest token's where given."""
    batch = runner.graph_batch(spans) or extend_batch(
        spans, runner.kv_pool, runner.req_to_token_pool, runner.attention, runner.device
    )
    outputs = runner.forward_every_token(batch)
    raw_logits, hidden = outputs.logits, outputs.hidden
    eos_token_ids = runner.model_config.eos_token_ids
    logits = processed_verify_logits(raw_logits, requests, trees, eos_token_ids)
    chains = [tree.tokens for tree in trees]  # trees under a grammar are chains
    logits = grammar_masked_verify_logits(logits, requests, chains, unprocessed=raw_logits)
    lens = batch.extend_lens
    # One device-to-host copy for every greedy request's targets, not one per request.
    argmax = logits.argmax(dim=-1).tolist()
    starts = [0, *itertools.accumulate(lens)][:-1]
    draws = target_draws(requests, trees, logits, starts, default_generator)
    all_hidden = hidden.split(lens)
    # Log-probabilities are the model's own, before any penalty (as `sample`'s caller).
    all_raw = raw_logits.split(lens)
    result = VerifyResult([], [], [], [], [], [], [])
    writes = []  # row-table writes of requests that keep a tree's branch
    kept_rows: list[list[int]] = []
    # A greedy request follows the target's argmax, a sampled one its own draws.
    targets = [draws.get(i) or argmax[s : s + n] for i, (s, n) in enumerate(zip(starts, lens))]
    verdicts = accept_on_host(trees, targets)
    for i, (req, tree, span, verdict) in enumerate(zip(requests, trees, spans, verdicts)):
        path = verdict.path
        if not tree.is_chain:
            write = taken.keep_path(req, span.slots, path)
            if write is not None:
                writes.append(write)
        # The rows of the kept path: a chain's are its span's first, a tree's gathered.
        rows = list(range(lens[i])) if tree.is_chain else [0] + [n + 1 for n in path]
        if kept_width is not None:
            rows += [0] * (kept_width - len(rows))
        kept_rows.append(rows)
        kept_logits = all_raw[i]
        if req.params.logprobs is not None and not tree.is_chain:
            kept_logits = kept_logits[rows]
        result.tokens.append(verdict.tokens)
        result.logprobs.append(_logprobs(req, kept_logits, verdict.tokens))
        result.num_accepted.append(verdict.num_accepted)
        result.num_drafts.append(tree.depth)
        result.num_proposed.append(len(tree))
        result.num_outputs_before.append(len(req.output_token_ids))
    runner.req_to_token_pool.write_many(writes)
    if kept_width is None and all(tree.is_chain for tree in trees):
        result.hidden = list(all_hidden)
    else:  # one gather for every request's kept rows
        flat = [start + r for start, rows in zip(starts, kept_rows) for r in rows]
        kept = hidden.index_select(0, int_tensor(flat, hidden.device))
        result.hidden = list(kept.split([len(rows) for rows in kept_rows]))
    return result


def _logprobs(req: Request, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
    if req.params.logprobs is None:
        return [None] * len(tokens)
    rows = logits[: len(tokens)]
    return compute_logprobs(rows, torch.tensor(tokens), [req.params] * len(tokens))
