"""What a prefill node keeps per request, from its PrefillRequest until its transfer ends, and
the requests of parallel samples that share a prompt's prefill."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.request import Request
from engine.tracing import RequestTrace, set_time
from metadata.messages import ParallelSample
from metadata.transfer import TransferHandle
from metadata.wire import PoolMessages


@dataclass
class Pending:
    req: Request
    decode_node: int
    decode_rank: int
    meta_row: int | None = None
    handle: TransferHandle | None = None
    announced: bool = False
    # Decided when the transfer is announced: the draft depths' KV follows the target's.
    drafted: bool = False
    # The target's KV as messages, for a request alone for its decode node in its batch: its
    # transfer begins as soon as the forward is enqueued (`PrefillNode._begin_transfers`).
    target_kv: PoolMessages | None = None
    # A parallel sample: the room whose transfer carries its prompt's target KV (0: its own).
    prompt_room: int = 0
    # Leading prompt positions whose KV the decode node holds (PrefillRequest.reused_tokens):
    # the transfer leaves them out.
    reused_tokens: int = 0

    @property
    def carries_prompt(self) -> bool:
        return self.prompt_room == 0


def sample_pending(carrier: Pending, sample: ParallelSample) -> Pending:
    """A parallel sample of `carrier`'s prompt: the same prompt (tokens and vectors, the same
    objects, as `EngineCore.add_samples` wants them), its own room and seed."""
    req = carrier.req
    fork = Request(
        str(sample.room), req.prompt_token_ids, dataclasses.replace(req.params, seed=sample.seed)
    )
    fork.prompt_embeds = req.prompt_embeds
    fork.num_draft_tokens = req.num_draft_tokens
    if req.trace is not None:
        fork.trace = RequestTrace()
        set_time(fork, "prefill_queued")
    room = int(req.request_id)
    return Pending(fork, carrier.decode_node, carrier.decode_rank, prompt_room=room)


def drafts_after_first_token(req: Request) -> bool:
    """Whether `req` drafts once its first token is out (`Request.lookahead` then): a request
    with a single token left to emit after the first never verifies, so it drafts nothing."""
    remaining = req.params.max_tokens - len(req.output_token_ids) - 2
    return min(req.num_draft_tokens, remaining) > 0
