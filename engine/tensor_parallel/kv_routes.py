"""Which prefill rank sends which KV heads to which decode rank, when a prefill node of TP a hands
a request's KV to a decode node of TP b.

Both nodes place KV heads as `TensorParallelLayout` does: rank r holds `local` consecutive heads
from `first(r)`, each head replicated on `replicas` consecutive ranks where there are fewer KV
heads than ranks. A decode rank needs exactly its own heads; each comes from one prefill rank
that holds it, so a head replicated on several prefill ranks is sent once per decode rank that
holds it. Among a head's prefill holders, decode rank d takes it from the holder `d % replicas`
along: nodes of the same layout then pair rank i with rank i, and a prefill node's replicas
share the sending when the decode node replicates too.

Route (0, 0) always exists (decode rank 0's first head, head 0, is prefill rank 0's): it is the
part of a transfer that crosses the nodes' own channel, beside the draft depths' KV and the
metadata row; every other route has a channel of its own between the two ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVHeads:
    """How `size` ranks hold `num_kv_heads` KV heads (the rule of TensorParallelLayout)."""

    size: int
    num_kv_heads: int

    @property
    def local(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def replicas(self) -> int:
        return max(1, self.size // self.num_kv_heads)

    def first(self, rank: int) -> int:
        return rank // self.replicas * self.local

    def splits(self) -> str | None:
        """Why `size` ranks cannot hold these heads (None: they can)."""
        kv, size = self.num_kv_heads, self.size
        if size < 1 or (kv >= size and kv % size) or (kv < size and size % kv):
            return f"tp_size {size} neither divides num_kv_heads {kv} nor is a multiple of it"
        return None


@dataclass(frozen=True)
class KVRoute:
    """KV heads [first_head, first_head + num_heads) of the model, sent by one prefill rank to
    one decode rank."""

    prefill_rank: int
    decode_rank: int
    first_head: int
    num_heads: int

    @property
    def on_node_channel(self) -> bool:
        return self.prefill_rank == 0 and self.decode_rank == 0


def kv_routes(num_kv_heads: int, prefill_size: int, decode_size: int) -> tuple[KVRoute, ...]:
    """Every route of a pairing, by decode rank then head; each decode rank's heads are
    covered exactly once. The sizes must hold the heads (`KVHeads.splits`)."""
    prefill = KVHeads(prefill_size, num_kv_heads)
    decode = KVHeads(decode_size, num_kv_heads)
    routes = []
    for d in range(decode_size):
        head, end = decode.first(d), decode.first(d) + decode.local
        while head < end:
            block = head // prefill.local  # the prefill ranks holding `head` hold this block
            sender = block * prefill.replicas + d % prefill.replicas
            stop = min(end, (block + 1) * prefill.local)
            routes.append(KVRoute(sender, d, head, stop - head))
            head = stop
    return tuple(routes)
