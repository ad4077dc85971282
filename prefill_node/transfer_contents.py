"""What a prefill node's transfer of a request carries: the pools and slots its KV is read from,
the metadata row it writes (first token, hidden state, draft state), the leading target KV
posted as soon as the forward is enqueued, and the stand-in pools of a void transfer. The KV of
the positions the decode node holds already (`Pending.reused_tokens`) is left out, in the
target and in every draft depth."""

from __future__ import annotations

from collections import Counter

import torch

from engine.sampling.sampler import TokenLogprob
from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.wire import PoolMessages
from prefill_node.pending import Pending
from spec import MultiLayerEagleWorker
from spec.runtime.sample_extend import shared_prompt_len


def prepare_early_kv(batch: list[Pending], kv_pool: KVPool) -> None:
    """Build the target KV messages of the transfers that begin as soon as the forward is
    enqueued (`PrefillNode._begin_transfers`): those of a request that is its decode node's
    only one in the batch. The rest of a transfer goes after the first token, and NCCL matches
    a pair's operations by order alone, so no other transfer to that node may start in
    between. Built here, before the forward, so that posting them after it is quick."""
    # A parallel sample's transfer (no target KV) follows its carrier's, which `prefilled`
    # finishes first: only the prompts count.
    prompts = [pending for pending in batch if pending.carries_prompt]
    per_peer = Counter(pending.decode_rank for pending in prompts)
    for pending in prompts:
        if per_peer[pending.decode_rank] == 1:
            req = pending.req
            prompt = req.slots[pending.reused_tokens : len(req.prompt_token_ids)]
            pending.target_kv = PoolMessages.build([(kv_pool, prompt)])


def write_transfer(
    pending: Pending,
    kv_pool: KVPool,
    speculator: MultiLayerEagleWorker | None,
    metadata: MetadataBuffers,
    logprob: TokenLogprob | None,
    last_hidden: torch.Tensor,
) -> list[tuple[KVPool, list[int]]]:
    """Write the metadata row of `pending`'s transfer and return the pools and slots its KV is
    read from: the prompt's target KV (a carrier's), and each draft depth's when it drafted."""
    req = pending.req
    prompt_len, reused = req.kv_len, pending.reused_tokens
    pools = []
    if pending.carries_prompt:
        pools.append((kv_pool, req.slots[reused:prompt_len]))
    draft_fields = {}
    if pending.drafted:
        state = speculator.export_state(req)
        depths = speculator.depth_kv(req, prompt_len, not pending.carries_prompt)
        pools += [(pool, slots[reused:]) for pool, slots in depths]
        last_hidden = state.target_hidden
        draft_fields = {
            "topk_index": torch.tensor(state.draft_token_ids),
            "topk_p": torch.tensor(state.draft_probs),
            "boundary_hidden": state.boundary_hidden,
        }
    metadata.write_row(
        pending.meta_row,
        room=int(req.request_id),
        output_id=req.output_token_ids[0],
        output_logprob=logprob.logprob if logprob else 0.0,
        hidden_state=last_hidden,
        **draft_fields,
    )
    return pools


def void_pools(
    kv_pool: KVPool,
    speculator: MultiLayerEagleWorker | None,
    num_tokens: int,
    drafted: bool,
    carries_prompt: bool = True,
    reused_tokens: int = 0,
) -> list[tuple[KVPool, list[int]]]:
    """The announced pools, each with slots [1, count]: as many as a transfer that ran
    (num_tokens less the reused ones, and a parallel sample's depths from `shared_prompt_len`
    on). They exist whatever state the failure left (the target's pool holds the request's
    num_tokens slots, and each depth's pool is as large), and are only read."""
    sent = num_tokens - reused_tokens
    pools = [(kv_pool, sent)] if carries_prompt else []
    if drafted:
        for d, runner in enumerate(speculator.depths):
            first = 0 if carries_prompt else shared_prompt_len(num_tokens, d)
            pools.append((runner.kv_pool, sent - first))
    return [(pool, list(range(1, count + 1))) for pool, count in pools]


def sent_and_reused(pending: Pending) -> tuple[int, int]:
    """The prompt positions whose target KV `pending`'s transfer carries, and those it leaves
    to the decode node's own (none sent for a parallel sample: its carrier's brings them)."""
    if not pending.carries_prompt:
        return 0, 0
    reused = pending.reused_tokens
    return len(pending.req.prompt_token_ids) - reused, reused
