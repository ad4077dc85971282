"""A decode node's reuse of the KV it holds: a conversation's next turn takes only the KV of the
tokens it does not hold already from its prefill node.

The decode node runs a prefix cache (engine.scheduling.prefix_cache): a finished request's KV (its
prompt and its output, the target's and, when it speculates, every draft depth's through
spec.runtime.prefix_drafts) stays there until the pool needs room. Before it asks a prefill node to
run a request, the node matches the prompt (all of it but its last token) against that cache and
holds the match (`hold_prefix`); the match's length goes to the prefill node in the
PrefillRequest (`reused_tokens`), which computes the whole prompt as always, announces the same
count back, and sends the KV of positions [reused_tokens, prompt length) only, in the target
and in each draft depth, then the metadata row. The received KV lands in the slots after the
held ones, so the request's slots read as one prompt.

The decode node decides alone and before anything is sent, so there is no miss to recover
from: a prefix evicted before the turn came is no match (a full transfer), and once matched it
is held until the request lets go. A request with parallel samples, or a prompt partly given as
vectors, reuses nothing (and a request that matched nothing still holds the cache's root, so
that its own KV enters the cache when it ends)."""

from __future__ import annotations

from engine.engine_core import EngineCore
from engine.request import Request
from metadata.messages import TransferAnnounce


def hold_prefix(requests: list[Request], engine: EngineCore) -> int:
    """Start a lone request (`requests`: it, then the parallel samples of its prompt) at the
    longest prefix of its prompt that this node's prefix cache holds, holding it; returns how
    many leading positions it reuses (0 without a cache, with samples, or where it cannot)."""
    kv_cache = engine.kv_cache
    if len(requests) > 1 or not kv_cache.match_prefix(requests[0]):
        return 0
    return requests[0].cached_len


def let_go_prefix(requests: list[Request], engine: EngineCore) -> None:
    """Undo `hold_prefix` for a request that could not preallocate after all."""
    first = requests[0]
    if first.cache_node is not None and first.row is None:
        engine.kv_cache.unmatch(first)


def received_tokens(announce: TransferAnnounce | None) -> tuple[int, int]:
    """The prompt positions whose target KV the announced transfer brings, and those it leaves
    to what this node holds (none brought for a parallel sample, whose carrier's brings them,
    nor without an announcement)."""
    if announce is None or announce.prompt_room != 0:
        return 0, 0
    return announce.num_tokens - announce.reused_tokens, announce.reused_tokens
