"""Which TCP sockets a set of processes listens on, read from /proc (Linux): /proc/net/tcp and
tcp6 give each listening socket's address and inode, /proc/<pid>/fd links name the inodes a
process holds."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"


@dataclass(frozen=True)
class ListeningSocket:
    pid: int
    command: str
    address: str
    port: int


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state in this network namespace."""
    found: dict[int, tuple[str, int]] = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == TCP_LISTEN:
                hex_address, hex_port = local.split(":")
                found[inode] = (_address(hex_address, family), int(hex_port, 16))
    return found


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # The command name in parentheses may hold spaces; the parent follows the state.
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, stack = set(), [root]
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack.extend(children.get(pid, []))
    return found


def _command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def listening_sockets(pids: set[int]) -> list[ListeningSocket]:
    inodes = _listening_inodes()
    found = []
    for pid in sorted(pids):
        try:
            command = _command(pid)
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                address, port = inodes[int(target[8:-1])]
                found.append(ListeningSocket(pid, command, address, port))
    return found
