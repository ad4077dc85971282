"""What a node that generates streams to the router after a step: a request's tokens since its
last update, their log-probabilities in wire form, and, once it ended, why (an error naming the
node, or the finish reason with the node's statistics; a decode node's below)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from decode_node.tracked import Tracked
from engine.request import Request
from metadata.messages import TokenUpdate
from metadata.node_metrics import SpeculationTotals


def token_update(
    room: int,
    req: Request,
    sent_tokens: int,
    node_name: str,
    final_stats: Callable[[], dict[str, Any]],
) -> TokenUpdate:
    """The update for `req` past its first `sent_tokens` output tokens. `final_stats` is called
    once, when the request finished without an error, for the stats its last update carries."""
    new = req.output_token_ids[sent_tokens:]
    logprobs = [
        [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top_logprobs]]
        for lp in req.logprobs[sent_tokens:]
    ]
    if req.error is not None:
        return TokenUpdate(room, new, logprobs, error=f"{node_name}: {req.error}")
    stats = final_stats() if req.finished else {}
    return TokenUpdate(room, new, logprobs, req.finish_reason, stats=stats)


def decode_final_stats(
    tracked: Tracked, decode_index: int, spec_totals: SpeculationTotals
) -> dict[str, Any]:
    """The statistics a decode node's last update of `tracked` carries: which nodes served it,
    its speculation figures, and both nodes' timelines when traced."""
    req = tracked.req
    stats = {
        "prefill_node": tracked.message.prefill_node,
        "decode_node": decode_index,
        "stop_string": req.stopped_by_string,
        **spec_totals.usage(req),
    }
    if req.trace is not None:
        prefill = tracked.result.trace if tracked.result is not None else []
        stats["trace"] = {"prefill": prefill, "decode": req.trace.events}
    return stats
