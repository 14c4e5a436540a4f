"""The loopback store alone (no launch): it serves on 127.0.0.1 only, stops serving at ``close()``, and closes only
the descriptors it owns; and what a launch hosting no store of its own must not pass on to its ranks."""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import pytest

from tests.listening import listening
from workbench.run.loopback_store import ENV_STORE, LoopbackStore, connect_store, inherited_variables


def test_it_serves_on_loopback_only_and_stops_at_close() -> None:
    store = LoopbackStore()
    assert listening([os.getpid()]) == [("127.0.0.1", store.port)]
    client = connect_store(("127.0.0.1", store.port), timeout=timedelta(seconds=5))
    client.set("k", b"v")
    assert client.get("k") == b"v"
    del client
    store.close()
    assert listening([os.getpid()]) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", store.port), timeout=2)


def test_close_leaves_a_descriptor_the_server_gave_back_to_someone_else_alone() -> None:
    # the server closes the descriptor it serves on when it goes; the process may hand that number out again at
    # once (a ZMQ socket, a log file) and close() must not close it a second time
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        store = LoopbackStore()
        store._store = None  # the server goes first, as at the start of close()
        with tempfile.TemporaryFile() as victim:
            store.close()
            victim.write(b"still open")  # OSError (EBADF) if close() closed this number
            victim.flush()
    assert len(os.listdir("/proc/self/fd")) == before  # and nothing leaks


def test_a_launch_without_a_store_drops_only_what_a_store_chose() -> None:
    with LoopbackStore() as store:
        chosen = store.agent_environment({})  # nothing set by the user: the store picks lo for gloo and NCCL
        assert chosen[ENV_STORE] == store.endpoint
        assert chosen.get("GLOO_SOCKET_IFNAME") == chosen.get("NCCL_SOCKET_IFNAME") == "lo"
        assert sorted(inherited_variables(chosen)) == sorted(chosen)
        mine = store.agent_environment({"GLOO_SOCKET_IFNAME": "eth1"})  # the user's choice stays theirs
        assert "GLOO_SOCKET_IFNAME" not in mine
        user = {**mine, "GLOO_SOCKET_IFNAME": "eth1"}
        assert "GLOO_SOCKET_IFNAME" not in inherited_variables(user)
        assert ENV_STORE in inherited_variables(user)
    assert inherited_variables({"GLOO_SOCKET_IFNAME": "lo"}) == []  # set by the user, no store: kept
