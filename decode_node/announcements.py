"""The decode node's checks of a TransferAnnounce before it posts receives for it: whether any
receive may be posted at all, and whether it is the transfer a request expects."""

from __future__ import annotations

from decode_node.tracked import Tracked
from metadata.messages import TransferAnnounce


def unreceivable(
    announce: TransferAnnounce, prefill_ranks: dict[int, int], max_len: int
) -> tuple[str | None, bool]:
    """Why no receive at all may be posted for `announce`, if none may, and whether the channel
    from its rank is then out of order for good: a rank that is not one of this node's prefill
    peers sends it nothing, and a token count no prompt has (outside 1..max_len) is no transfer
    of this cluster's, whose scratch would be unbounded, and so is a reused count outside
    0..num_tokens-1."""
    rank, room = announce.prefill_rank, announce.room
    if rank not in prefill_ranks.values():
        return f"room {room} was announced by rank {rank}, which is no prefill node's", False
    if not 1 <= announce.num_tokens <= max_len:
        return (
            f"room {room} was announced with {announce.num_tokens} tokens, not 1..{max_len}",
            True,
        )
    if not 0 <= announce.reused_tokens < announce.num_tokens:
        return (
            f"room {room} was announced with {announce.reused_tokens} of its "
            f"{announce.num_tokens} tokens reused",
            True,
        )
    return None, False


def refusal(
    announce: TransferAnnounce, tracked: Tracked, prefill_ranks: dict[int, int]
) -> str | None:
    """Why `announce` is not the transfer `tracked`'s request expects, if it is not: from
    another rank than its prefill node's, a second one, another token count than its
    prompt's, another count of reused positions than it asked for (decode_node.reuse), draft
    depths it does not receive (0 or all of this node's), or a prompt KV carried by another
    transfer than the one it shares (parallel samples)."""
    room, rank = announce.room, announce.prefill_rank
    prefill = tracked.message.prefill_node
    expected_rank = prefill_ranks.get(prefill)
    if rank != expected_rank:
        return (
            f"room {room} was announced by rank {rank}, but its prefill went to "
            f"prefill-{prefill} (rank {expected_rank})"
        )
    if tracked.announce is not None:
        return f"room {room} was announced twice by prefill-{prefill}"
    prompt_len = len(tracked.req.prompt_token_ids)
    if announce.num_tokens != prompt_len:
        return f"prefill announced {announce.num_tokens} tokens, expected {prompt_len}"
    if announce.reused_tokens != tracked.reused_tokens:
        return (
            f"prefill-{prefill} announced {announce.reused_tokens} reused tokens, this node "
            f"holds {tracked.reused_tokens}"
        )
    shared = tracked.group.prompt_room(tracked) if tracked.group is not None else 0
    if announce.prompt_room != shared:
        return (
            f"room {room} was announced with the prompt KV of room {announce.prompt_room or room}"
            f", expected room {shared or room}'s"
        )
    depths = tracked.req.num_draft_tokens
    if announce.num_draft_tokens not in (0, depths):
        return (
            f"prefill-{prefill} announced {announce.num_draft_tokens} draft depths, this "
            f"node receives {depths}"
        )
    return None
