"""Close a rank's process-group TCP connections, so that peers blocked in a gloo collective with it get an error.

Destroying a process group closes its gloo connections only when nothing else holds it: a live ``DeviceMesh``,
an FSDP module or a DTensor keep the C++ group (and its sockets) alive, and gloo's ``abort``/``shutdown`` do not
close them either (torch 2.13). A rank left waiting in a collective that its peers have left would then wait
forever (gloo's default timeout is 30 minutes). ``sever`` shuts (``shutdown(SHUT_RDWR)``, never ``close``: the
file descriptors stay owned by gloo) every established TCP connection of this process except those on the ports
given to keep (the rendezvous store, the kernel's ZMQ socket): gloo's loop then sees the connection end, and the
collective raises "Connection closed by peer" on both sides. Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

__all__ = ["established_tcp", "sever"]

_ESTABLISHED = "01"  # st column of /proc/net/tcp


def established_tcp() -> list[tuple[int, int, int]]:
    """``(fd, local_port, remote_port)`` of this process's established TCP connections (IPv4 and IPv6)."""
    inodes: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[len("socket:["):-1]] = int(fd)
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _ESTABLISHED and cols[9] in inodes:
                local, remote = (int(c.rsplit(":", 1)[1], 16) for c in (cols[1], cols[2]))
                found.append((inodes[cols[9]], local, remote))
    return found


def sever(keep_ports: Iterable[int]) -> int:
    """Shut down every established TCP connection of this process not on ``keep_ports``; return how many."""
    keep = set(keep_ports)
    count = 0
    for fd, local, remote in established_tcp():
        if local in keep or remote in keep:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays gloo's
    return count
