"""The checkpoint a publish replaces is deleted where no other save can be, and nothing else is deleted with it.

After the exchange the old checkpoint used to lie at ``.NAME.incomplete`` with no owner marker until the publisher
deleted it by that name: another process's save to the same path took it for a dead save's, removed it and started
its own there, and the first publisher's cleanup then deleted that live save.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.io.support import save_checkpoint
from workbench.errors import CheckpointError
from workbench.faults import fault_hook
from workbench.io.files import publish
from workbench.io.files.ownership import MARKER_NAME, claimed_here, read_owner
from workbench.io.files.publish import AtomicRenamePublisher
from workbench.io.files.publish_types import is_temporary_path
from workbench.io.files.read import CheckpointReader

OLD = {"w": torch.full((4, 3), 1.0)}
NEW = {"w": torch.full((4, 3), 2.0)}


def _save(final: Path, tensors: dict[str, torch.Tensor]) -> AtomicRenamePublisher:
    publisher = AtomicRenamePublisher(final)
    save_checkpoint(publisher.prepare(), tensors)
    publisher.finalize()
    return publisher


def _value(path: Path) -> float:
    with CheckpointReader(path) as reader:
        return float(reader.read("w")[0, 0])


def _unpublished(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if is_temporary_path(p))


def test_the_replaced_checkpoint_is_deleted_away_from_the_temporary_name(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    _save(final, OLD)
    seen: list[tuple[bool, list[str], bool, bool]] = []

    def look(point: str, rank: int, detail: object) -> None:
        if point == "cleanup":  # published: the old checkpoint is about to be deleted
            (old,) = _unpublished(tmp_path)
            owner = read_owner(old)
            seen.append((os.path.lexists(tmp_path / ".ckpt.incomplete"), [p.name for p in _unpublished(tmp_path)],
                         owner is not None and owner.pid == os.getpid(), claimed_here(old)))

    with fault_hook(look):
        _save(final, NEW)
    ((at_temporary, names, marked, claimed),) = seen
    assert not at_temporary and names[0].startswith(".ckpt.replaced-"), names
    assert marked and claimed  # live to every process while it is deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and _value(final) == 2.0


def test_the_cleanup_deletes_only_the_directory_it_replaced(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    _save(final, OLD)

    def swap_in_a_stranger(point: str, rank: int, detail: object) -> None:
        if point == "cleanup":  # another directory now lies where the old checkpoint is to be deleted
            (old,) = _unpublished(tmp_path)
            old.rename(tmp_path / "moved-away")
            old.mkdir()
            (old / "data.bin").write_bytes(b"not the publisher's")

    with fault_hook(swap_in_a_stranger):
        _save(final, NEW)
    (stranger,) = _unpublished(tmp_path)
    assert (stranger / "data.bin").read_bytes() == b"not the publisher's"
    assert _value(final) == 2.0 and _value(tmp_path / "moved-away") == 1.0


def test_a_replaced_checkpoint_that_cannot_be_deleted_is_left_to_the_next_save(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    _save(final, OLD)

    def fail(point: str, rank: int, detail: object) -> None:
        if point == "cleanup":
            raise OSError(errno.EIO, "simulated")

    with fault_hook(fail), pytest.warns(UserWarning, match=r"replaced checkpoint at .*/\.ckpt\.incomplete could not"):
        _save(final, NEW)
    left = tmp_path / ".ckpt.incomplete"
    assert _value(left) == 1.0 and not (left / MARKER_NAME).exists()  # stale: no save holds it
    _save(final, NEW)  # the next save removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_abort_after_a_failed_exchange_removes_the_new_checkpoint_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "ckpt"
    _save(final, OLD)
    publisher = AtomicRenamePublisher(final)
    save_checkpoint(publisher.prepare(), NEW)

    def another_save_then_fail(a: Path, b: Path) -> bool:
        (tmp_path / ".ckpt.incomplete").mkdir()  # the name was free: another save made its directory there
        (tmp_path / ".ckpt.incomplete" / "data.bin").write_bytes(b"another save's")
        raise OSError(errno.EIO, "simulated", str(a), None, str(b))

    monkeypatch.setattr(publish, "exchange_paths", another_save_then_fail)
    with pytest.raises(CheckpointError, match="simulated"):
        publisher.finalize()
    publisher.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.incomplete", "ckpt"] and _value(final) == 1.0
    assert (tmp_path / ".ckpt.incomplete" / "data.bin").read_bytes() == b"another save's"


SECOND_SAVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import workbench as wb
    from workbench.faults import fault_hook

    root = Path(sys.argv[1])

    def hold(point, rank, detail):
        if point == "write":  # its files are being written into .ckpt.incomplete: wait for the first save's cleanup
            (root / "b_writing").touch()
            deadline = time.monotonic() + 120
            while not (root / "a_done").exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    with fault_hook(hold):
        wb.save_hf({"w": torch.full((4, 3), 3.0)}, root / "ckpt", write_threads=1)
    print("published")
    """
)


def test_a_save_of_another_process_started_during_the_cleanup_is_not_deleted(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    _save(final, OLD)
    second: list[subprocess.Popen] = []

    def start_another_save(point: str, rank: int, detail: object) -> None:
        if point == "cleanup":  # the first save is published and about to delete the old checkpoint
            root = Path(__file__).resolve().parents[2]
            second.append(subprocess.Popen([sys.executable, "-c", SECOND_SAVER, str(tmp_path)], cwd=root,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            deadline = time.monotonic() + 120
            while not (tmp_path / "b_writing").exists() and second[0].poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)

    try:
        with fault_hook(start_another_save):
            _save(final, NEW)
        (tmp_path / "a_done").touch()
        output, _ = second[0].communicate(timeout=120)
    finally:
        for proc in second:
            if proc.poll() is None:
                proc.kill()
    assert second[0].returncode == 0 and output.strip().endswith("published"), output
    assert _value(final) == 3.0  # the second save, published after the first


def test_the_next_save_removes_a_replaced_checkpoint_whose_deleter_died_and_keeps_a_live_one(tmp_path: Path) -> None:
    # a publisher killed while it deleted the old checkpoint leaves it at its private name: a whole checkpoint of
    # disk that only clean_incomplete found
    import json

    final = tmp_path / "ckpt"
    _save(final, OLD)
    dead, live = (tmp_path / f".ckpt.replaced-{n}-0123456789ab.incomplete" for n in (1, 2))
    for leftover in (dead, live):
        save_checkpoint(leftover, OLD)
    from workbench.io.files.ownership import LiveClaim, write_owner

    write_owner(live)  # held by this process, as a publisher holds the one it deletes
    claim = LiveClaim(live)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = write_owner(dead)
    body = json.loads(marker.read_text())
    marker.write_text(json.dumps({**body, "pid": int(child.stdout)}))  # a process of this host that has ended
    other = tmp_path / ".other.replaced-3-0123456789ab.incomplete"  # another checkpoint's: not this save's to judge
    other.mkdir()
    try:
        _save(final, NEW)
    finally:
        claim.release()
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert torch.equal(CheckpointReader(final).read("w"), NEW["w"])
