"""The collectives a tensor parallel engine uses, over a gloo process group of its own.

Each engine builds its own `ProcessGroupGloo` from a TCP store that rank 0 hosts on a free
loopback port: nothing goes through torch.distributed's global default group, so several engines
(and their tests) live side by side in one process. Ops wait without a practical timeout, since
a follower waits for rank 0's next forward for as long as the engine sits idle; a rank that dies
closes its sockets, which fails the others' pending ops at once."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
# How long a rank may take to reach the store (a follower imports torch and the engine first).
STORE_TIMEOUT = datetime.timedelta(minutes=5)
# Ops have no deadline of their own: see the module docstring.
OP_TIMEOUT = datetime.timedelta(days=3650)


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's store, on a port the OS picks (its `port` is what the followers dial)."""
    return dist.TCPStore(
        LOOPBACK, 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
    )


def dial_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=STORE_TIMEOUT)


def joined_key(rank: int) -> str:
    """The store key a follower sets once it has dialled the store, before the group forms."""
    return f"joined/{rank}"


@dataclass
class RankGroup:
    """This process's rank among `size`, and the collectives over their group."""

    group: dist.ProcessGroupGloo
    rank: int
    size: int

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int) -> RankGroup:
        """Form the group; blocks until every rank has called it."""
        return cls(dist.ProcessGroupGloo(store, rank, size, OP_TIMEOUT), rank, size)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """`tensor` becomes the sum of every rank's, in place (contiguous tensors only)."""
        self.group.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return parts

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's, in place."""
        self.group.broadcast(tensor, 0).wait()
