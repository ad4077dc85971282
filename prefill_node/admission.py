"""What a prefill node makes of a PrefillRequest: the pending entries of its request and of the
parallel samples that share its prompt, and the checks that may refuse them before they queue
(the prompt's embeddings, a grammar, which a shared prompt may not have)."""

from __future__ import annotations

from engine.engine_core import EngineCore
from engine.errors import RequestRejectedError
from engine.executor.prompt_embeds import PromptEmbeds
from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from engine.tracing import RequestTrace, set_time
from metadata.messages import PrefillRequest
from prefill_node.pending import Pending, sample_pending


def pending_group(msg: PrefillRequest, tracing: bool, num_draft_steps: int | None) -> list[Pending]:
    """The request of `msg`, then its parallel samples; `num_draft_steps`: None without
    speculation."""
    params = SamplingParams(**msg.sampling.__dict__)
    req = Request(str(msg.room), list(msg.prompt_token_ids), params)
    if tracing:
        req.trace = RequestTrace()
        set_time(req, "prefill_queued")
    if num_draft_steps is not None:
        req.num_draft_tokens = num_draft_steps
    pending = Pending(req, msg.decode_node, msg.decode_rank, reused_tokens=msg.reused_tokens)
    return [pending] + [sample_pending(pending, s) for s in msg.samples]


def admit_group(
    msg: PrefillRequest, group: list[Pending], engine: EngineCore, hidden_size: int
) -> None:
    """Give the group the prompt's embeddings and start its grammar; raises
    RequestRejectedError when this node refuses it."""
    req = group[0].req
    if msg.reused_tokens and (msg.samples or not 0 < msg.reused_tokens < req.num_tokens):
        # A transfer leaves out what the decode node holds, never the whole prompt (the decode
        # node matches all but its last token), and parallel samples reuse nothing.
        raise RequestRejectedError(
            f"{msg.reused_tokens} reused tokens of a {req.num_tokens}-token prompt"
            + (" with parallel samples" if msg.samples else "")
        )
    if msg.prompt_embeds is not None:
        given = msg.prompt_embeds
        embeds = PromptEmbeds.from_bytes(given.positions, given.width, given.data)
        embeds.check(req.num_tokens, hidden_size)
        for member in group:
            member.req.prompt_embeds = embeds
    if req.params.grammar is not None:
        if msg.samples:
            # A decode node never shares a prompt under a grammar: refused rather
            # than sent as transfers it does not expect.
            raise RequestRejectedError("parallel samples under a grammar are not shared")
        engine.start_grammar(req)
