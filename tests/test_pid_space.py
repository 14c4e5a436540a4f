"""A pid names a process only in its own PID space: the kernel signals a rank's pid, and a save judges an owner's pid,
only when host name, boot and PID namespace are all this process's."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest
import zmq

from workbench.kernel.protocol import Link, encode, new_identity
from workbench.kernel.ranks import RankSet
from workbench.pid_space import PidSpace, in_this_pid_space, this_pid_space

pytestmark = pytest.mark.skipif(not Path("/proc/self/ns/pid").exists(), reason="the kernel names no PID namespace")

BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip() if Path("/proc").exists() else ""


def test_this_pid_space_is_what_proc_says() -> None:
    assert this_pid_space() == PidSpace(BOOT, os.readlink("/proc/self/ns/pid"))
    assert this_pid_space().known and not PidSpace().known and not PidSpace(BOOT).known


def test_only_the_same_host_boot_and_namespace_is_this_pid_space() -> None:
    here, host = this_pid_space(), socket.gethostname()
    assert in_this_pid_space(host, here)
    assert not in_this_pid_space(host, PidSpace(here.boot, "pid:[1]"))  # another container on this host name
    assert not in_this_pid_space(host, PidSpace("another-boot", here.namespace))  # before a reboot
    assert not in_this_pid_space(host, PidSpace())  # nothing recorded (an older workbench)
    assert not in_this_pid_space(host + "-other", here)


def test_the_kernel_treats_a_rank_as_local_only_in_its_own_pid_space(tmp_path: Path) -> None:
    """A rank that says it runs on the kernel's host name but reports another PID namespace (a container sharing the
    node's name) is not signalled or read from here: its pid would name some other process of the kernel's space."""
    rankset = RankSet(nprocs=0, backend="gloo", listen="127.0.0.1:0", token_file=str(tmp_path / "token"),
                      log=logging.getLogger("test.pid_space"))
    context = zmq.Context()
    key = (tmp_path / "token").read_text().strip().encode()
    here = this_pid_space()
    places = [{"boot": here.boot, "pid_namespace": here.namespace},
              {"boot": here.boot, "pid_namespace": "pid:[1]"},
              {}]
    try:
        for rank, place in enumerate(places):
            identity = new_identity(rank)
            peer = context.socket(zmq.DEALER)
            peer.setsockopt(zmq.IDENTITY, identity.encode())
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(rankset.address)
            link = Link(key, me="rank", rank=rank, identity=identity)
            peer.send_multipart(link.seal(encode({"op": "hello", "rank": rank, "world_size": 3, "local_rank": rank,
                                                  "host": socket.gethostname(), "pid": os.getpid(),
                                                  "backend": "gloo", **place})))
            assert rankset.recv(5.0)[1]["op"] == "hello"
        assert [rankset.on_this_host(rank) for rank in range(3)] == [True, False, False]
    finally:
        rankset.close()
        context.destroy(linger=0)


def test_where_no_side_names_its_pid_space_the_host_name_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without /proc (or one that hides the PID namespace): this process's own markers and its own
    ranks stay its own, as before spaces were recorded; a space recorded elsewhere is still not this one."""
    from workbench import pid_space

    monkeypatch.setattr(pid_space, "this_pid_space", lambda: PidSpace())
    assert in_this_pid_space(socket.gethostname(), PidSpace())
    assert not in_this_pid_space(socket.gethostname(), PidSpace(BOOT, "pid:[1]"))
    assert not in_this_pid_space(socket.gethostname() + "-other", PidSpace())


def test_a_marker_left_by_this_process_is_stale_where_no_pid_space_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench import pid_space
    from workbench.io.files import ownership
    from workbench.io.files.publish import AtomicRenamePublisher

    monkeypatch.setattr(pid_space, "this_pid_space", lambda: PidSpace())
    monkeypatch.setattr(ownership, "this_pid_space", lambda: PidSpace())
    leftover = tmp_path / ".ckpt.incomplete"
    leftover.mkdir()
    ownership.write_owner(leftover)  # an earlier attempt of this process that failed: no save holds it
    save = ownership.incomplete_save(leftover)
    assert not save.live and save.reason.startswith("left by this process"), save
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    assert publisher.prepare() == leftover  # replaced at once, not refused for five minutes
    publisher.abort()
