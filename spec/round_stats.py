"""A request's speculation statistics (`Request.spec_stats`), counted once per verify step:
what `usage` and the nodes' stats report."""

from __future__ import annotations

from engine.request import Request, SpecStats
from spec.acceptance import Verdict


def count_round(
    req: Request, num_drafts: int, num_proposed: int, verdict: Verdict, committed: int
) -> None:
    stats = req.spec_stats
    if stats is None:  # a request built without EngineCore.make_request
        stats = req.spec_stats = SpecStats()
    if len(stats.accepted_per_position) < num_drafts:
        stats.accepted_per_position.extend([0] * (num_drafts - len(stats.accepted_per_position)))
    # A stop condition may cut the committed tokens short of the accepted drafts.
    accepted = min(verdict.num_accepted, committed)
    stats.verify_steps += 1
    stats.proposed_tokens += num_proposed
    stats.accepted_tokens += accepted
    stats.emitted_tokens += committed
    for j in range(accepted):
        stats.accepted_per_position[j] += 1
