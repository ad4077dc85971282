"""A request's speculation statistics (`Request.spec_stats`), counted once per verify step:
what `usage` and the nodes' stats report."""

from __future__ import annotations

from engine.request import Request, SpecStats


def count_round(
    requests: list[Request],
    num_drafts: list[int],
    num_proposed: list[int],
    num_accepted: list[int],
    committed: list[int],
) -> None:
    """A round's counts, per request: draft positions it checked (0: it verified no draft this
    round, which is not a verify step), draft tokens it proposed and accepted, tokens it
    committed."""
    for req, drafts, proposed, accepted, emitted in zip(
        requests, num_drafts, num_proposed, num_accepted, committed
    ):
        if not drafts:
            continue
        stats = req.spec_stats
        if stats is None:  # a request built without EngineCore.make_request
            stats = req.spec_stats = SpecStats()
        per_position = stats.accepted_per_position
        if len(per_position) < drafts:
            per_position.extend([0] * (drafts - len(per_position)))
        # A stop condition may cut the committed tokens short of the accepted drafts.
        if emitted < accepted:
            accepted = emitted
        stats.verify_steps += 1
        stats.proposed_tokens += proposed
        stats.accepted_tokens += accepted
        stats.emitted_tokens += emitted
        for j in range(accepted):
            per_position[j] += 1
