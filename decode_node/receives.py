"""A decode node's side of a request's transfer: the pools an announced transfer lands in (or,
for one no request takes, the scratch sizes its messages need), why an ended transfer cannot
run, and making a landed transfer the request's own (its first token, its draft state)."""

from __future__ import annotations

from decode_node.tracked import RESULT_WAIT_S, Tracked
from engine.request import Request
from engine.sampling.sampler import TokenLogprob
from engine.scheduling.kv_pool import KVPool
from engine.tracing import set_time
from metadata.buffers import MetadataBuffers
from metadata.faults import DECODE_FAULT_PHASES, PREFILL_FAULT_PHASES, FaultInjector
from metadata.messages import TransferAnnounce
from metadata.transfer import TransferState
from metadata.wire import kv_nbytes
from spec import DraftState, MultiLayerEagleWorker
from spec.runtime.sample_extend import shared_prompt_len


def receive_pools(
    announce: TransferAnnounce,
    req: Request,
    kv_pool: KVPool,
    speculator: MultiLayerEagleWorker | None,
) -> list[tuple[KVPool, list[int]]]:
    """The pools and slots the announced transfer of `req` lands in: after the positions this
    node holds already (`reused_tokens`, decode_node.reuse), in the target and in each draft
    depth. When the prefill node drafted nothing, the request decodes plainly and its reserved
    draft slots go back now."""
    prompt_len, reused = len(req.prompt_token_ids), announce.reused_tokens
    pools = []
    if announce.prompt_room == 0:  # not a parallel sample's (the carrier's brings its KV)
        pools.append((kv_pool, req.slots[reused:prompt_len]))
    if announce.num_draft_tokens:
        depths = speculator.depth_kv(req, prompt_len, announce.prompt_room != 0)
        pools += [(pool, slots[reused:]) for pool, slots in depths]
    elif req.num_draft_tokens:
        # The prefill node drafted nothing (one token left to emit after the first): this
        # request decodes plainly, and its reserved draft slots go back now.
        speculator.release(req)
        req.num_draft_tokens = 0
    return pools


def scratch_sizes(
    announce: TransferAnnounce,
    kv_pool: KVPool,
    speculator: MultiLayerEagleWorker | None,
    row_nbytes: int,
) -> tuple[list[int], str | None]:
    """The sizes of the messages of an announced transfer that no request takes, to receive
    into scratch (`KVReceiver.discard`); or why this node cannot receive it at all (draft
    depths it does not have), which leaves the channel from its rank out of order."""
    n, carries_prompt = announce.num_tokens, announce.prompt_room == 0
    sent = n - announce.reused_tokens
    sizes = [kv_nbytes(kv_pool, sent)] if carries_prompt else []
    if announce.num_draft_tokens:
        depths = speculator.depths if speculator is not None else []
        if len(depths) != announce.num_draft_tokens:
            reason = (
                f"room {announce.room} came with {announce.num_draft_tokens} draft depths, "
                f"which this node ({len(depths)} of its own) cannot receive"
            )
            return [], reason
        for d, depth in enumerate(depths):
            first = 0 if carries_prompt else shared_prompt_len(n, d)
            sizes.append(kv_nbytes(depth.kv_pool, sent - first))
    return sizes + [row_nbytes], None


def landing_error(tracked: Tracked, faults: FaultInjector) -> str | None:
    """Why the ended transfer of `tracked` (not aborted) cannot run, None if it landed."""
    handle = tracked.handle
    prefill = tracked.message.prefill_node
    if handle.state == TransferState.FAILED and handle.left_posted:
        # Timed out: no result is coming that would say more.
        return f"KV transfer from prefill-{prefill} failed: {handle.error}"
    if tracked.result is None:
        return (
            f"prefill-{prefill} sent no result for its transfer within "
            f"{RESULT_WAIT_S:g} s of its end"
        )
    if handle.state == TransferState.FAILED:
        return f"KV transfer from prefill-{prefill} failed: {handle.error}"
    if faults.transfer_fault(DECODE_FAULT_PHASES, earlier=PREFILL_FAULT_PHASES):
        return f"KV transfer from prefill-{prefill} failed: injected fault after it landed"
    return None


def adopt_landed(
    tracked: Tracked, metadata: MetadataBuffers, speculator: MultiLayerEagleWorker | None
) -> None:
    """Make the landed transfer the request's: its first token (with its top logprobs), the
    prompt's KV, and its draft state when it came with one; its metadata row is freed."""
    req = tracked.req
    if req.trace is not None:
        landed = {
            "bytes": tracked.handle.nbytes,
            "wire_ms": tracked.wire_seconds() * 1e3,
            "reused_tokens": tracked.reused_tokens,
        }
        set_time(req, "transfer_end", landed)
    row = tracked.meta_row
    first = int(metadata.output_ids[row])
    if req.params.logprobs is not None:
        top = [(int(t), float(lp)) for t, lp in tracked.result.first_token_top_logprobs]
        req.logprobs.append(TokenLogprob(first, float(metadata.output_logprob[row]), top))
    req.kv_len = len(req.prompt_token_ids)
    req.commit(first)
    if tracked.announce.num_draft_tokens:
        speculator.adopt(req, draft_state(metadata, row, req.kv_len))
    metadata.free(row)
    tracked.meta_row = None


def draft_state(metadata: MetadataBuffers, row: int, prompt_len: int) -> DraftState:
    return DraftState(
        prompt_len,
        metadata.topk_index[row].tolist(),
        metadata.topk_p[row].tolist(),
        metadata.hidden_states[row].clone(),
        metadata.boundary_hidden[row].clone(),
    )
