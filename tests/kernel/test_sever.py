"""``sever``: this process's TCP connections shut down (the peer sees the end), except those on kept ports."""

from __future__ import annotations

import socket
import sys

import pytest

from workbench.kernel.sever import established_tcp, sever

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sever reads /proc (Linux only)")


def test_sever_shuts_connections_except_kept_ports() -> None:
    others = {port for _, local, remote in established_tcp() for port in (local, remote)}  # not ours to touch
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        with client, accepted:
            mine = {fd for fd, _, _ in established_tcp()}
            assert {client.fileno(), accepted.fileno()} <= mine
            assert sever(others | {port}) == 0  # both ends touch the kept port
            client.sendall(b"still open")
            assert accepted.recv(16) == b"still open"
            assert sever(others) == 2
            accepted.settimeout(5)
            assert accepted.recv(16) == b""  # end of stream: a peer blocked in recv returns
            with pytest.raises(OSError):
                client.sendall(b"x")
            assert client.fileno() >= 0  # shut down, not closed: the descriptor stays its owner's
