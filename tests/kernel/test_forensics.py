"""What the kernel reads of a rank that cannot answer: faulthandler's dump of a process holding the GIL in a C
call (``stackdump``) and the collective ledger (``ledger``), in one process or a child, no kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workbench.kernel.ledger import Ledger, member_ranks, read_ledger, track
from workbench.kernel.stackdump import Frame, dump, format_frames, parse, summarize

ROOT = Path(__file__).resolve().parents[2]

# a faulthandler dump as CPython 3.11 writes it (two threads; the one that took the signal is "Current thread")
DUMP = """Thread 0x00007f70959366c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f70b9c34b80 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2801 in all_reduce
  File "<ipython-input-7-0123abcd>", line 3 in step
  File "<ipython-input-7-0123abcd>", line 5 in <module>
"""


def test_parse_picks_the_main_thread_innermost_last() -> None:
    frames = parse(DUMP, 0x00007F70B9C34B80)
    cell = "<ipython-input-7-0123abcd>"
    assert frames == [Frame(cell, 5, "<module>"), Frame(cell, 3, "step"),
                      Frame("/x/site-packages/torch/distributed/distributed_c10d.py", 2801, "all_reduce")]
    assert parse(DUMP, 0x1234) is None  # a thread not in the dump
    lines = {("<ipython-input-7-0123abcd>", 3): "dist.all_reduce(t)"}
    summary = summarize(format_frames(frames, lambda f, n: lines.get((f, n), "")))
    assert summary["in_collective"] is True
    assert summary["where"] == 'File "<ipython-input-7-0123abcd>", line 3, in step'
    assert summary["stack"][1] == '  File "<ipython-input-7-0123abcd>", line 3, in step\n    dist.all_reduce(t)\n'


CHILD = textwrap.dedent("""
    import ctypes, subprocess, sys, threading
    sys.path.insert(0, {root!r})
    from workbench.kernel.stackdump import register
    keep = register({path!r})
    def hold_the_gil():
        child = subprocess.Popen(["sh", "-c", "sleep 5; echo"], stdout=subprocess.PIPE)
        print(threading.main_thread().ident, flush=True)
        ctypes.PyDLL(None).read(child.stdout.fileno(), ctypes.create_string_buffer(1), 1)
    hold_the_gil()
""")


def test_dump_reads_the_stack_of_a_process_that_holds_the_gil(tmp_path: Path) -> None:
    path = str(tmp_path / "rank.stacks")
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT), path=path)], stdout=subprocess.PIPE,
                             text=True)
    try:
        thread = int(child.stdout.readline())
        time.sleep(0.3)  # into the C call
        start = time.monotonic()
        text = dump(child.pid, path)
        took = time.monotonic() - start
        assert text is not None and took < 1.5, took
        frames = parse(text, thread)
        assert [f.function for f in frames] == ["<module>", "hold_the_gil"], text
        assert child.poll() is None  # the signal did not end the call (nor the process)
    finally:
        child.kill()
        child.wait()
    assert dump(child.pid, path, timeout=0.2) is None  # a process that is gone


@pytest.fixture
def world() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_track_writes_each_collective_in_and_out(world: None, tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path / "rank0.ledger"))
    restore = track(ledger)
    try:
        assert dist.all_reduce is dist.distributed_c10d.all_reduce  # one wrapper, both names
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        after = read_ledger(ledger.path)
        assert after["state"] == "out" and after["last"]["op"] == "all_reduce" and after["last"]["seq"] == 1
        assert after["last"]["group"] == "default (ranks 0)"
        assert member_ranks(after["last"]) == {0}  # the kernel reads who is in the group from here, not the label
        group = dist.new_group([0])
        dist.all_reduce(t, group=group)
        dist.all_reduce(t, group=group)
        assert read_ledger(ledger.path)["last"]["seq"] == 2  # numbered per group
        assert read_ledger(ledger.path)["last"]["group"].endswith("(ranks 0)")
        assert read_ledger(ledger.path)["last"]["group"] != "default (ranks 0)"
        objects = [None]
        dist.all_gather_object(objects, {"rank": 0})
        assert objects == [{"rank": 0}]
        assert read_ledger(ledger.path)["last"]["op"] == "all_gather_object"  # its inner all_gather nested
    finally:
        restore()
    assert not hasattr(dist.all_reduce, "__wrapped_by_workbench__")  # the originals are back


def test_a_reader_sees_the_collective_a_blocked_rank_is_in(world: None, tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path / "rank0.ledger"))
    restore = track(ledger)
    inside, release = threading.Event(), threading.Event()  # a rank blocked in a collective, read from outside
    try:
        def blocked() -> None:
            call = ledger.enter("all_gather_object", None)  # an object collective, whose inner call then waits
            try:
                inner = ledger.enter("all_gather", None)
                inside.set()
                release.wait(10)
                ledger.leave(inner)
            finally:
                ledger.leave(call)

        thread = threading.Thread(target=blocked)
        thread.start()
        assert inside.wait(10)
        record = read_ledger(ledger.path)
        assert record["state"] == "in" and record["op"] == "all_gather" and record["within"] == "all_gather_object"
        assert record["seq"] == 2 and time.time() - record["since"] < 10
        release.set()
        thread.join()
        after = read_ledger(ledger.path)
        assert after["state"] == "out" and after["last"]["op"] == "all_gather_object" and after["last"]["seq"] == 1
    finally:
        restore()
    assert read_ledger(str(tmp_path / "missing")) is None


def test_a_ranks_folder_is_made_private_or_refused(tmp_path: Path) -> None:
    # in a shared /tmp another user could make /tmp/workbench-kernel-<uid> first and plant links to this user's
    # files, which a rank then overwrote with its stacks and ledger
    import os
    import stat

    from workbench.kernel.worker import private_folder

    new = tmp_path / "new"
    assert private_folder(str(new)) == str(new) and stat.S_IMODE(new.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    private_folder(str(loose))
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700  # this user's own: narrowed
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(RuntimeError, match="is not a directory"):
        private_folder(str(tmp_path / "link"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # planted before this user's first rank ran
    with pytest.raises(RuntimeError, match="is not a directory"):
        private_folder(str(tmp_path / "dangling"))
    if os.geteuid() == 0:  # only root can give a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o777)
        os.chown(theirs, 12345, 12345)
        with pytest.raises(RuntimeError, match=r"belongs to uid 12345, not to this user"):
            private_folder(str(theirs))


def test_a_call_records_its_groups_ranks_whatever_their_number() -> None:
    from workbench.kernel.ledger import _members

    stepped = _members(list(range(3, 1024, 8)))  # one mesh dim of 1,024 ranks: 128 ranks, 8 apart
    assert stepped == {"first": 3, "last": 1019, "step": 8}
    assert member_ranks({"members": stepped}) == set(range(3, 1024, 8))
    assert member_ranks({"members": _members([5, 1, 2])}) == {1, 2, 5}  # uneven: listed
    assert _members([*range(100), 200]) is None  # uneven and long: not recorded (the kernel falls back)
    for unknown in (None, {}, {"group": "default (ranks 0-3)"}, {"members": {"first": 0}}, {"members": 7},
                    {"members": {"first": 0, "last": 3, "step": 0}}):
        assert member_ranks(unknown) is None
