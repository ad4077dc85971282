"""What a decode node keeps per request it serves, from its GenerateRequest to its end, and the
questions about that request's transfer that need nothing else."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.engine_core import EngineCore
from engine.request import Request
from metadata.kv_audit import PoolCount, request_pools
from metadata.messages import GenerateRequest, PrefillResult, TransferAnnounce
from metadata.transfer import TransferHandle

if TYPE_CHECKING:
    from decode_node.samples import SampleGroup
    from decode_node.token_streams import RequestStream
    from metadata.buffers import MetadataBuffers
    from metadata.rank_kv import RankLanding

# How long a transfer that ended waits for its PrefillResult, which the prefill node sends before
# the KV: only a lost message or a dead prefill node makes it wait this long.
RESULT_WAIT_S = 5.0


@dataclass
class Tracked:
    req: Request
    message: GenerateRequest
    stream: RequestStream
    meta_row: int | None = None
    handle: TransferHandle | None = None
    aborted: bool = False
    announce: TransferAnnounce | None = None
    result: PrefillResult | None = None
    result_at: float | None = None  # perf_counter when the serving loop took the result
    ended_at: float | None = None  # when its transfer was first seen ended, without a result
    # The parallel samples of its prompt that share its prefill (decode_node.samples), if any.
    group: SampleGroup | None = None
    # Leading prompt positions whose KV this node holds already (decode_node.reuse), which
    # its transfer leaves out.
    reused_tokens: int = 0
    # Its target KV beyond what lands in rank 0's pool (metadata.rank_kv): the other ranks'
    # heads, and rank 0's when staged, written into the pools once the transfer has landed.
    landing: RankLanding | None = None

    def free_row(self, metadata: MetadataBuffers) -> None:
        """Give back its metadata row, if it holds one."""
        if self.meta_row is not None:
            metadata.free(self.meta_row)
            self.meta_row = None

    def settled(self) -> bool:
        """Its ended transfer can be acted on: its PrefillResult came (or is not needed, or is
        overdue). Without the result a void transfer would fail as a room tag mismatch rather
        than with the prefill's error, and a landed one would lack its top logprobs."""
        if self.aborted or self.result is not None or self.handle.left_posted:
            return True
        now = time.monotonic()
        if self.ended_at is None:
            self.ended_at = now
        return now - self.ended_at > RESULT_WAIT_S

    def wire_seconds(self) -> float:
        """The landed transfer's own time as this side sees it: from when its KV could start to
        flow (the receive posted, and the PrefillResult taken, which the prefill node sends
        just before the KV) to its landing; the receive itself waits through the prefill's
        forward. A result that a busy serving loop took late makes it an underestimate: for
        traces only."""
        handle = self.handle
        posted, landed = handle.time_of("posted"), handle.time_of("landed")
        if posted is None or landed is None:
            return handle.elapsed_s
        start = max(posted, min(self.result_at or posted, landed))
        return landed - start


def held_pools(
    engine: EngineCore,
    speculator,
    metadata: MetadataBuffers,
    rooms: dict[int, Tracked],
    quarantined: list[Request],
) -> list[PoolCount]:
    """A decode node's pools as its KV audit counts them: everything is held by a request it
    tracks (`rooms`), one quarantined, or its prefix cache; rows by the requests holding one."""
    requests = [tracked.req for tracked in rooms.values()] + quarantined
    rows_held = sum(1 for tracked in rooms.values() if tracked.meta_row is not None)
    return request_pools(
        engine.runner.kv_pool.allocator.num_used,
        requests,
        speculator,
        (metadata.num_rows - metadata.num_free, rows_held),
        cached=engine.kv_cache.cached_slots(),
    )
