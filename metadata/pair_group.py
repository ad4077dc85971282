"""The data-plane channel of one prefill/decode pair: a two-rank process group of its own.

Each pair has its own group, made by the two nodes alone on the launcher's rendezvous store
under a key of the pair and an epoch (`PairLink`). So a node that dies and is replaced re-pairs
with each peer in a new group of a new epoch, while every other pair's group, and the requests
moving through it, stay as they were: there is no group of all nodes to rebuild. Ranks name the
node slots (prefill i, decode j) for the cluster's lifetime; a replacement takes its slot's rank.

NCCL between GPUs, gloo on CPU and for nodes sharing a GPU (metadata.transfer, `host_staged`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from metadata.channel import Channel
from metadata.loopback import is_loopback
from metadata.process_group import backend_for, keep_group_sockets_on_loopback


@dataclass(frozen=True)
class PairLink:
    """Where and under which key two nodes make their pair's group. `epoch` counts the pair's
    groups: a replacement of either node pairs under a new one. `peer_tp`: the peer's tensor
    parallel size, from which the two nodes' ranks derive their KV links (metadata.rank_kv),
    made under the pair's key too. `peer_name`: the peer node's, for errors."""

    store_host: str
    store_port: int
    peer_rank: int
    epoch: int
    peer_tp: int = 1
    peer_name: str = ""

    def key(self, own_rank: int) -> str:
        low, high = sorted((own_rank, self.peer_rank))
        return f"pair/{low}-{high}/epoch-{self.epoch}/"


def open_pair_channel(
    link: PairLink,
    own_rank: int,
    device: str | torch.device,
    through_host: bool = False,
    timeout_s: float = 120.0,
) -> Channel:
    """Make the pair's group (blocks until the peer makes its side, up to `timeout_s`) and the
    channel that posts on it. `through_host`: gloo although the pools are on a GPU."""
    if own_rank == link.peer_rank:
        raise ValueError(f"rank {own_rank} cannot pair with itself")
    torch_device = torch.device(device)
    backend = "gloo" if through_host else backend_for(torch_device)
    if is_loopback(link.store_host):
        keep_group_sockets_on_loopback()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(link.store_host, link.store_port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(link.key(own_rank), store)
    own_in_pair = 0 if own_rank < link.peer_rank else 1
    if backend == "nccl":
        torch.cuda.set_device(torch_device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, own_in_pair, 2, options)
        return Channel(group, 1 - own_in_pair, coalesce=True)
    group = dist.ProcessGroupGloo(prefixed, own_in_pair, 2, timeout)
    return Channel(group, 1 - own_in_pair, coalesce=False)
