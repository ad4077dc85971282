"""Pairing nodes: the control-plane handshake (endpoints, transfer specs checked) and a
data-plane channel per prefill/decode pair (metadata.pair_group), first for the whole cluster
at launch, then for each replacement with the peers alive at the time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from metadata.pair_group import PairLink


@dataclass
class NodeSlot:
    """One node of the cluster across its replacements: the current actor and what it
    described of itself (`describe()`: endpoint and transfer spec)."""

    role: str  # "prefill", "decode" or "replica"
    index: int
    rank: int  # its data-plane rank; a replica has none that is used
    actor: object
    info: dict
    up: bool = True

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def tp_size(self) -> int:
        """Its tensor parallel size, as its transfer spec says."""
        return self.info.get("spec", {}).get("tp_size", 1)


@dataclass
class PairEpochs:
    """The epoch of each pair's group: a new group of a pair takes a new key on the store."""

    store_host: str
    store_port: int
    _epochs: dict[tuple[int, int], int] = field(default_factory=dict)

    def link(self, own: NodeSlot, peer: NodeSlot) -> PairLink:
        return PairLink(
            self.store_host,
            self.store_port,
            peer.rank,
            self._epochs.get(_pair(own.rank, peer.rank), 0),
            peer.tp_size,
            peer.name,
        )

    def renew(self, rank: int, peer_rank: int) -> None:
        key = _pair(rank, peer_rank)
        self._epochs[key] = self._epochs.get(key, 0) + 1


def _pair(a: int, b: int) -> tuple[int, int]:
    return (min(a, b), max(a, b))


Get = Callable[[list, str], list]  # ray.get with the cluster's timeout and error wording


def pair_cluster(
    prefill: list[NodeSlot],
    decode: list[NodeSlot],
    epochs: PairEpochs,
    get: Get,
) -> None:
    """Connect every node to its peers, then open every pair's channel, all pairs at once.
    (Front ends introduce themselves to the nodes: cluster.control.router.)"""
    connect_decode(decode, prefill, get)
    connect_prefill(prefill, decode, get)
    refs = [
        slot.actor.pair_with.remote(slot.rank, [epochs.link(slot, p) for p in peers])
        for slot, peers in [(s, decode) for s in prefill] + [(s, prefill) for s in decode]
    ]
    get(refs, "node")


def connect_decode(decode: list[NodeSlot], prefill: list[NodeSlot], get: Get) -> None:
    endpoints = {p.index: p.info["endpoint"] for p in prefill}
    specs = {p.index: p.info["spec"] for p in prefill}
    ranks = {p.index: p.rank for p in prefill}
    get([d.actor.connect.remote(endpoints, specs, ranks) for d in decode], "decode")


def connect_prefill(prefill: list[NodeSlot], decode: list[NodeSlot], get: Get) -> None:
    endpoints = {d.index: d.info["endpoint"] for d in decode}
    get([p.actor.connect.remote(endpoints) for p in prefill], "prefill")


def pair_replacement(
    slot: NodeSlot,
    peers: list[NodeSlot],
    all_peers: list[NodeSlot],
    epochs: PairEpochs,
    get: Get,
) -> None:
    """Pair `slot`'s new actor with the live `peers` (new pair groups under new epochs; each
    peer swaps its socket and channel for the new node's) after connecting it to `all_peers`
    (the ones down too: a peer's endpoint is replaced when it comes back)."""
    if slot.role == "decode":
        connect_decode([slot], all_peers, get)
    else:
        connect_prefill([slot], all_peers, get)
    for peer in peers:
        epochs.renew(slot.rank, peer.rank)
    endpoint = slot.info["endpoint"]
    refs = [slot.actor.pair_with.remote(slot.rank, [epochs.link(slot, p) for p in peers])]
    for peer in peers:
        link = epochs.link(peer, slot)
        if slot.role == "decode":
            refs.append(peer.actor.peer_replaced.remote(slot.index, endpoint, link))
        else:
            spec = slot.info["spec"]
            refs.append(peer.actor.peer_replaced.remote(slot.index, endpoint, spec, link))
    get(refs, slot.role)
