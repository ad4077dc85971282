"""A request's draft state crossing from a prefill node to a decode node: what the prefill
side sends after its draft extend (`export_state`, `depth_kv`), and what the decode side
reserves before the transfer and takes over after it (`reserve`, `adopt`). The worker's
methods of the same names call these with its depths."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request import Request
from engine.scheduling.kv_pool import KVPool
from spec.runtime.draft_runner import DraftRunner
from spec.runtime.sample_extend import share_prompt, shared_prompt_len
from spec.runtime.state import DraftState, SpecRequestState


def export_state(req: Request, k: int, hidden_size: int) -> DraftState:
    """What a prefill node sends for `req` right after its draft extend over the prompt, with
    `k` depths over a target of `hidden_size`."""
    state: SpecRequestState = req.spec_state
    boundary = torch.zeros(
        k - 1, hidden_size, dtype=state.target_hidden.dtype, device=state.target_hidden.device
    )
    for d, value in enumerate(state.boundary):
        if value is not None:
            boundary[d] = value
    return DraftState(
        req.num_tokens - 1,
        list(state.chain),
        list(state.chain_probs),
        state.target_hidden.clone(),
        boundary,
    )


def depth_kv(
    depths: list[DraftRunner], req: Request, num_positions: int, shares_prompt: bool
) -> list[tuple[KVPool, list[int]]]:
    """Each depth's pool and the slots of positions [0, num_positions), depth 0 first: what a
    transfer sends after the target's KV, or receives into. `shares_prompt`: the transfer of a
    parallel sample whose prompt another's transfer carries: positions from
    `shared_prompt_len` on only."""
    state: SpecRequestState = req.spec_state
    return [
        (runner.kv_pool, seq.slots[_first(shares_prompt, num_positions, d) : num_positions])
        for d, (runner, seq) in enumerate(zip(depths, state.seqs))
    ]


def reserve(
    depths: list[DraftRunner],
    req: Request,
    num_positions: int,
    new_state: Callable[[], SpecRequestState],
    prompt_of: Request | None,
) -> None:
    """Take slots for positions [0, num_positions) in every depth: a decode node reserves the
    prompt (what the transfer fills) and the first step's draft extend, as many as it takes in
    the target; later extends grow each depth themselves. `new_state()`: a request's empty
    draft state. `prompt_of`: the parallel sample whose transfer carries the prompt `req`
    shares, reserved already: `req` holds its slots for the positions the samples share
    (`shared_prompt_len`)."""
    if req.spec_state is None:
        req.spec_state = new_state()
        if prompt_of is not None:
            assert req.prompt_token_ids == prompt_of.prompt_token_ids, "one prompt"
            shared = prompt_of.spec_state.seqs
            share_prompt(depths, shared, req.spec_state, len(req.prompt_token_ids))
    for runner, seq in zip(depths, req.spec_state.seqs):
        runner.grow_to(seq, num_positions)


def adopt(req: Request, sent: DraftState, k: int) -> None:
    """Take over a request of `k` depths whose KV landed in the slots `reserve` took."""
    state: SpecRequestState = req.spec_state
    n = sent.num_prefilled
    assert req.kv_len == n == req.num_tokens - 1, "adopt right after the first token"
    assert len(sent.draft_token_ids) >= k
    for d, seq in enumerate(state.seqs):
        assert len(seq.slots) >= n
        seq.valid_len = max(0, n - d)
    state.chain = list(sent.draft_token_ids[:k])
    state.chain_probs = list(sent.draft_probs[:k])
    state.boundary = [sent.boundary_hidden[d] if n - d - 1 >= 0 else None for d in range(k - 1)]
    state.target_hidden = sent.target_hidden


def _first(shares_prompt: bool, num_prompt: int, depth: int) -> int:
    return shared_prompt_len(num_prompt, depth) if shares_prompt else 0
