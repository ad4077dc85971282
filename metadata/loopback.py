"""Loopback addresses and the loopback interface: a cluster whose every rank runs on this host
keeps the sockets it listens on there."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

# From Linux's <net/if.h>: the flag of the interface that only loops back.
IFF_LOOPBACK = 0x8


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface only ("localhost", 127.0.0.0/8,
    ::1, or ::ffff:127.x.y.z); 0.0.0.0, :: and every other address do not."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def loopback_interface() -> str | None:
    """The name of the loopback interface ("lo" on Linux), or None where the system does not
    say (gloo and NCCL choose interfaces by name, not by address)."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & IFF_LOOPBACK:
            return name
    return None
