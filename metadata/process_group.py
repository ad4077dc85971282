"""The data-plane process group: every prefill and decode node process is one rank of it.

The launcher owns a TCPStore server (`create_store_server`) on a port the OS picks, and hands
host and port to the nodes through Ray; each node then joins with `init_transfer_group`. NCCL
between GPUs, gloo on CPU. This initializes the default torch.distributed group of the node
process, so the KV transfer (metadata.transfer) uses it without being passed a group.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from metadata.loopback import is_loopback, loopback_interface

# The variables by which gloo and NCCL choose the interfaces their sockets use.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def create_store_server(host: str, timeout_s: float = 600) -> tuple[dist.TCPStore, int]:
    """Start the rendezvous store listening on `host` only; returns it (keep it alive as long as
    the group) and its port."""
    # TCPStore binds every interface when it opens its own socket, so it is given one bound to
    # `host`, on a port the OS picks so that two clusters can share a host.
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
            use_libuv=True,  # the backend that serves a socket it is given
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store, port


def init_transfer_group(
    store_host: str,
    store_port: int,
    rank: int,
    world_size: int,
    device: str,
    timeout_s: float = 600,
    backend: str | None = None,
) -> None:
    """`backend`: None picks by device (`backend_for`); "gloo" on a CUDA device for nodes that
    share a GPU (NCCL will not pair a GPU with itself), whose transfers then stage through host
    memory (metadata.transfer, `host_staged`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        # NCCL binds communicators to the current device; p2p comms are created lazily per peer
        # pair, on whatever device is current at the time, so set it before anything else.
        torch.cuda.set_device(torch_device)
    if is_loopback(store_host):
        keep_group_sockets_on_loopback()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=backend or backend_for(torch_device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def keep_group_sockets_on_loopback() -> None:
    """A store on loopback means every rank runs on this host: gloo's pairs and NCCL's
    bootstrap then listen on the loopback interface too, instead of the interface the host
    name resolves to (or, for NCCL, the first that is not loopback). An interface the operator
    chose is kept."""
    interface = loopback_interface()
    if interface is None:
        return
    for variable in INTERFACE_VARIABLES:
        os.environ.setdefault(variable, interface)


def destroy_transfer_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
