"""The private store alone (no launch): files in a directory only this user can open, no socket, removed at
``close()``; and what a launch making no store of its own must not pass on to its ranks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time

from tests.listening import listening
from workbench.run.private_store import (
    ABANDONED_AFTER,
    ENV_STORE,
    PrivateStore,
    connect_store,
    inherited_variables,
)


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


def _ended_pid() -> int:
    """A pid that ran and is gone (reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_store_whose_maker_was_killed_goes_at_the_next_store_and_no_other(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = time.time() - ABANDONED_AFTER - 5

    def left(pid: int, *, host: str | None = None, changed: float = old, record: bool = True) -> str:
        """A store as a maker killed with SIGKILL leaves it: its files, no close()."""
        store = PrivateStore()
        owner = os.path.join(store.directory, "owner.json")
        if record:
            with open(owner) as f:
                made = json.load(f)
            with open(owner, "w") as f:
                json.dump({**made, "pid": pid, "host": host or made["host"]}, f)
        else:
            os.remove(owner)
        with open(store.ranks, "w") as f:
            f.write("x")
        for name in os.listdir(store.directory):
            os.utime(os.path.join(store.directory, name), (changed, changed))
        os.utime(store.directory, (changed, changed))
        return store.directory

    alive = left(os.getpid())  # its maker runs: a live kernel's store
    recent = left(_ended_pid(), changed=time.time())  # its ranks may still be ending
    elsewhere = left(_ended_pid(), host="another-host")  # a pid of another host says nothing here
    unrecorded = left(_ended_pid(), record=False)  # an older workbench's: cannot be judged
    dead = left(_ended_pid())  # each store made above swept the folder: these are kept
    assert os.path.isdir(dead)
    with PrivateStore() as store:
        assert not os.path.exists(dead)
        assert all(os.path.isdir(d) for d in (alive, recent, elsewhere, unrecorded, store.directory))
