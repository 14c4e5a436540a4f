"""The private store alone (no launch): files in a directory only this user can open, no socket, removed at
``close()``; and what a launch making no store of its own must not pass on to its ranks."""

from __future__ import annotations

import os
import stat

from tests.listening import listening
from workbench.run.private_store import ENV_STORE, PrivateStore, connect_store, inherited_variables


def test_its_files_are_this_users_alone_and_go_at_close() -> None:
    store = PrivateStore()
    info = os.stat(store.directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert os.path.dirname(store.rendezvous) == os.path.dirname(store.ranks) == store.directory
    ranks = connect_store(store.ranks)
    ranks.set("k", b"v")
    assert ranks.get("k") == b"v"
    assert listening([os.getpid()]) == []  # no socket: nothing another user of the host could connect to
    del ranks
    store.close()
    assert not os.path.exists(store.directory)


def test_a_launch_without_a_store_drops_only_what_a_store_chose() -> None:
    with PrivateStore() as store:
        chosen = store.agent_environment({})  # nothing set by the user: the store picks lo for gloo and NCCL
        assert chosen[ENV_STORE] == store.ranks
        assert chosen.get("GLOO_SOCKET_IFNAME") == chosen.get("NCCL_SOCKET_IFNAME") == "lo"
        assert sorted(inherited_variables(chosen)) == sorted(chosen)
        mine = store.agent_environment({"GLOO_SOCKET_IFNAME": "eth1"})  # the user's choice stays theirs
        assert "GLOO_SOCKET_IFNAME" not in mine
        user = {**mine, "GLOO_SOCKET_IFNAME": "eth1"}
        assert "GLOO_SOCKET_IFNAME" not in inherited_variables(user)
        assert ENV_STORE in inherited_variables(user)
    assert inherited_variables({"GLOO_SOCKET_IFNAME": "lo"}) == []  # set by the user, no store: kept
