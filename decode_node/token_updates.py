"""What a node that generates streams to the router after a step: a request's tokens since its
last update, their log-probabilities in wire form, and, once it ended, why (an error naming the
node, or the finish reason with the node's statistics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.request import Request
from metadata.messages import TokenUpdate


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
