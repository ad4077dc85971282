"""A node's side of the KV transfer per tensor parallel rank: each decode rank receives exactly
its own KV heads, straight from a prefill rank that holds them (engine/tensor_parallel/
kv_routes.py says which), a head replicated on several prefill ranks sent by one of them.

Route (0, 0), prefill rank 0's heads that decode rank 0 holds, crosses the nodes' own channel
as the target pool's message of the transfer (metadata.transfer), beside the draft depths' KV
and the metadata row, which stay rank 0's; when both nodes have one rank it is the whole pool,
and nothing below runs. Every other route has a link of its own between its two ranks
(engine/tensor_parallel/kv_links.py), opened when the nodes pair (`pair`) and driven by rank 0
through orders to its followers: the prefill node's ranks post their sends after the forward
(`send`), the decode node's ranks post their receives at the announcement (`expect`) and write
what landed into their pools once rank 0's own part has landed (`land`), before the request is
admitted.

The node channel's message holds the route's heads only: taken straight from (landed straight
into) the pool where they are all of rank 0's heads, else through a staging pool
(`outgoing_pools`, `incoming_pools`)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from engine.executor.model_runner import ModelRunner
from engine.loading.loader import ModelSpec
from engine.scheduling.kv_pool import KVPool
from engine.tensor_parallel.kv_links import KVLinks, LinkPlan, LinkSpec, slot_index
from engine.tensor_parallel.kv_routes import KVHeads, KVRoute, kv_routes
from engine.tensor_parallel.link_orders import LinkOrder
from engine.tensor_parallel.orders import Order
from metadata.loopback import is_loopback, loopback_interface
from metadata.pair_group import PairLink

PoolsAndSlots = list[tuple[KVPool, list[int]]]
log = logging.getLogger(__name__)


class RankKV:
    """The routes of this node (`name`, of `tp_size` ranks) with each peer node, and its ranks'
    links for them; `sends`: this is the prefill end."""

    def __init__(
        self,
        runner: ModelRunner,
        sends: bool,
        num_kv_heads: int,
        tp_size: int,
        timeout_s: float,
        name: str,
    ) -> None:
        self.runner = runner
        self.sends = sends
        self.name = name
        self.heads = KVHeads(tp_size, num_kv_heads)
        self.timeout_s = timeout_s
        self.links = KVLinks(runner.kv_pool)  # rank 0's own
        self.routes: dict[int, tuple[KVRoute, ...]] = {}  # by peer's data-plane rank
        self._open: set[int] = set()  # peers whose links every rank has open
        # Bytes of KV heads landed through the links, by "prefill p -> decode d".
        self.landed: Counter[str] = Counter()

    @classmethod
    def of(
        cls, runner: ModelRunner, spec: ModelSpec, sends: bool, timeout_s: float, name: str
    ) -> RankKV:
        """Node `name`'s, whose runner serves `spec`."""
        tp_size = spec.engine_config.tensor_parallel_size
        return cls(runner, sends, spec.model_config.num_kv_heads, tp_size, timeout_s, name)

    def pair(self, links: list[PairLink], own_rank: int) -> None:
        """Derive the routes with each peer of `links` and open every rank's links for them
        (each waits for its other end); RuntimeError naming this node, its side, the peers and
        the ranks that could not."""
        specs = [spec for link in links for spec in self._plan(link, own_rank)]
        peers = {link.peer_rank for link in links}
        self._open -= peers
        if specs:
            host, port = links[0].store_host, links[0].store_port
            interface = loopback_interface() if is_loopback(host) else None
            plan = LinkPlan(host, port, self.timeout_s, interface, tuple(specs))
            order = LinkOrder(Order.OPEN_LINKS, plan=plan.to_bytes())
            statuses = self.runner.run_link_order(order, self.links)
            errors = [f"rank {r}: {s.error}" for r, s in enumerate(statuses) if s.error]
            if errors:
                names = ", ".join(peer_name(link) for link in links)
                raise RuntimeError(
                    f"{self.name} ({self.side} end): opening the KV links with {names} failed: "
                    + "; ".join(errors)
                )
        self._open |= peers

    @property
    def side(self) -> str:
        return "prefill" if self.sends else "decode"

    def _plan(self, link: PairLink, own_rank: int) -> list[LinkSpec]:
        own, peer = self.heads.size, link.peer_tp
        prefill_tp, decode_tp = (own, peer) if self.sends else (peer, own)
        routes = kv_routes(self.heads.num_kv_heads, prefill_tp, decode_tp)
        self.routes[link.peer_rank] = routes
        specs = []
        for route in routes:
            if route.on_node_channel:
                continue
            rank = route.prefill_rank if self.sends else route.decode_rank
            key = f"{link.key(own_rank)}tp-{route.prefill_rank}-{route.decode_rank}/"
            local_first = route.first_head - self.heads.first(rank)
            specs.append(LinkSpec(link.peer_rank, rank, route, self.sends, key, local_first))
        return specs

    def is_open(self, peer: int) -> bool:
        """Whether every rank has its links with `peer` open."""
        return peer in self._open

    def uses_links(self, peer: int) -> bool:
        """Whether transfers with `peer` cross more than the node channel."""
        return any(not route.on_node_channel for route in self.routes.get(peer, ()))

    def node_heads(self, peer: int) -> int:
        """How many KV heads cross the node channel with `peer` (route (0, 0)'s)."""
        routes = self.routes.get(peer)
        if routes is None:  # not paired yet: a one-rank pair's, the whole pool
            return self.runner.kv_pool.num_kv_heads
        return routes[0].num_heads

    def send(self, peer: int, room: int, slots: list[int] | None, num_tokens: int) -> None:
        """Every rank posts its routes' heads at `slots` to `peer` (None: zeros, for a void
        transfer); on the thread that runs the forwards, after the one that wrote them."""
        if self.uses_links(peer):
            index = None if slots is None else slot_index(slots)
            order = LinkOrder(Order.SEND_KV, peer, room, num_tokens, index)
            self.runner.run_link_order(order, self.links)

    def expect(self, peer: int, room: int, num_tokens: int) -> None:
        """Every rank posts the receives of its routes' heads of an announced transfer."""
        if self.uses_links(peer):
            order = LinkOrder(Order.RECV_KV, peer, room, num_tokens)
            self.runner.run_link_order(order, self.links)

    def land(self, peer: int, room: int, slots: list[int] | None) -> str | None:
        """Every rank waits for its heads of `room` and writes them at `slots` (None: drops
        them); returns why some did not land, naming the ranks, or None. On the thread that
        runs the forwards, before the request is admitted."""
        if not self.uses_links(peer):
            return None
        if slots is not None and peer not in self._open:
            # Links of a failed re-pairing may remain on some ranks, their receives posted.
            self.land(peer, room, None)
            return f"the KV links with rank {peer} are not open"
        index = None if slots is None else slot_index(slots)
        order = LinkOrder(Order.LAND_KV, peer, room, len(slots or ()), index, b"", self.timeout_s)
        statuses = self.runner.run_link_order(order, self.links)
        if slots is None:
            return None
        errors = [f"decode rank {r}: {s.error}" for r, s in enumerate(statuses) if s.error]
        pool = self.runner.kv_pool
        for route in self.routes[peer]:
            if route.on_node_channel:
                continue
            landed = (statuses[route.decode_rank].landed or {}).get(route.prefill_rank, 0)
            self.landed[f"prefill {route.prefill_rank} -> decode {route.decode_rank}"] += landed
            head_bytes = KVPool.bytes_per_token(pool.num_layers, 1, pool.head_dim, pool.dtype)
            if not errors and landed != len(slots) * route.num_heads * head_bytes:
                errors.append(
                    f"decode rank {route.decode_rank}: {landed} bytes landed from prefill rank "
                    f"{route.prefill_rank}, not {route.num_heads} heads of {len(slots)} tokens"
                )
        return "; ".join(errors) or None

    def forget(self, peer: int) -> None:
        """`peer` is gone: every rank drops its links with it (re-made when it is replaced).
        On the serving thread: a failure (a rank gone, which fails the node) is logged."""
        self._open.discard(peer)
        if not self.uses_links(peer):
            return
        try:
            self.runner.run_link_order(LinkOrder(Order.FORGET_PEER, peer), self.links)
        except Exception:  # noqa: BLE001 - see above
            log.exception("dropping the KV links with rank %d failed", peer)

    def stats(self) -> dict:
        """Bytes rank 0 sent through its links (by decode rank), and the bytes every rank
        landed through them (by route)."""
        return {"sent": dict(self.links.sent), "landed": dict(self.landed)}

    def node_pool(self, peer: int, num_tokens: int) -> KVPool:
        """A staging pool for route (0, 0)'s heads with `num_tokens` slots from 1."""
        pool = self.runner.kv_pool
        heads = self.node_heads(peer)
        return KVPool(
            max(1, num_tokens), pool.num_layers, heads, pool.head_dim, pool.dtype, pool.device
        )


def repair_rank_kv(rank_kv: RankKV, link: PairLink, own_rank: int) -> None:
    """Re-open every rank's links with a replaced peer, on the node's serving thread: a
    failure is logged, not raised (it would end the loop), and leaves the peer's links shut,
    so that its transfers fail (`RankKV.land`) and its channel is reported broken."""
    try:
        rank_kv.pair([link], own_rank)
    except Exception:  # noqa: BLE001 - see above
        log.exception(
            "%s (%s end): re-opening the KV links with %s failed",
            rank_kv.name,
            rank_kv.side,
            peer_name(link),
        )


def peer_name(link: PairLink) -> str:
    return link.peer_name or f"the node of data-plane rank {link.peer_rank}"


def _target(runner: ModelRunner, pools: PoolsAndSlots) -> int | None:
    """Where the target pool's slots are in `pools`, if it has any."""
    for i, (pool, slots) in enumerate(pools):
        if pool is runner.kv_pool and slots:
            return i
    return None


def outgoing_pools(
    rank_kv: RankKV, peer: int, pools: PoolsAndSlots, read: bool = True
) -> tuple[PoolsAndSlots, list[int] | None]:
    """A prefill node's pools for `KVSender.send` to `peer`, the target pool's holding route
    (0, 0)'s heads only (`read=False`: zeros, for a void transfer), and the target's slots
    (None: it carries no target KV) for `RankKV.send`."""
    runner = rank_kv.runner
    i = _target(runner, pools)
    if i is None:
        return pools, None
    pool, slots = pools[i]
    heads = rank_kv.node_heads(peer)
    if heads == pool.num_kv_heads:
        return pools, slots
    staging = rank_kv.node_pool(peer, len(slots))
    if read:
        rows = pool.kv_buffer.index_select(0, slot_index(slots))
        staging.kv_buffer[1:] = rows[:, :, :, :heads]
    out = list(pools)
    out[i] = (staging, list(range(1, len(slots) + 1)))
    return out, slots


@dataclass
class RankLanding:
    """A decode node's target KV of one transfer beyond what lands straight in rank 0's pool:
    route (0, 0)'s heads staged (when they are not all of rank 0's), and whether the other
    ranks' heads come through links. `slots`: the request's target slots."""

    peer: int
    room: int
    slots: list[int]
    staging: KVPool | None
    links: bool

    def expect(self, rank_kv: RankKV) -> None:
        """Have the ranks post the receives of their heads (after rank 0's own)."""
        if self.links:
            rank_kv.expect(self.peer, self.room, len(self.slots))

    def write(self, rank_kv: RankKV) -> str | None:
        """Write what landed into the ranks' pools; why it cannot, or None."""
        if self.staging is not None:
            n, heads = len(self.slots), self.staging.num_kv_heads
            target = rank_kv.runner.kv_pool.kv_buffer[:, :, :, :heads]
            target.index_copy_(0, slot_index(self.slots), self.staging.kv_buffer[1 : n + 1])
        return rank_kv.land(self.peer, self.room, self.slots) if self.links else None

    def drop(self, rank_kv: RankKV) -> None:
        """The request does not run: the ranks drop its heads as they land."""
        if self.links:
            rank_kv.land(self.peer, self.room, None)


def incoming_pools(
    rank_kv: RankKV, peer: int, room: int, pools: PoolsAndSlots
) -> tuple[PoolsAndSlots, RankLanding | None]:
    """A decode node's pools for `KVReceiver.expect` from `peer`, the target pool's holding
    route (0, 0)'s heads, and what else lands and where (None: nothing else), whose receives
    `RankLanding.expect` posts."""
    runner = rank_kv.runner
    i = _target(runner, pools)
    if i is None:
        return pools, None
    pool, slots = pools[i]
    links = rank_kv.uses_links(peer)
    staging = None
    if rank_kv.node_heads(peer) != pool.num_kv_heads:
        staging = rank_kv.node_pool(peer, len(slots))
        pools = list(pools)
        pools[i] = (staging, list(range(1, len(slots) + 1)))
    if staging is None and not links:
        return pools, None
    return pools, RankLanding(peer, room, list(slots), staging, links)
