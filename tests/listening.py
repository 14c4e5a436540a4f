"""Which TCP sockets a set of processes listens on, read from ``/proc`` (Linux): the test's own view of what a
launch exposes, independent of the code that set the sockets up."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

LOOPBACK = {"127.0.0.1", "::1"}


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return inodes


def _address(field: str, v6: bool) -> tuple[str, int]:
    ip, port = field.split(":")
    raw = bytes.fromhex(ip)
    if v6:  # four little-endian 32-bit words
        return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


def listening(pids: Iterable[int]) -> list[tuple[str, int]]:
    """``(host, port)`` of every listening TCP socket that one of ``pids`` holds open."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(_address(fields[1], v6))
    return sorted(found)
