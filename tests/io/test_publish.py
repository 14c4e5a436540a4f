"""AtomicRenamePublisher: the final path holds the old checkpoint or the new one, never a partial one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.io.support import edit_index, save_checkpoint
from workbench.errors import CheckpointError
from workbench.io.files import publish as publish_module
from workbench.io.files.index import INDEX_NAME, read_checkpoint
from workbench.io.files.ownership import MARKER_NAME
from workbench.io.files.publish import AtomicRenamePublisher, exchange_paths, is_complete, validate_final
from workbench.io.files.publish_types import Publisher, is_temporary_path, temporary_path
from workbench.io.files.read import CheckpointReader
from workbench.io.files.write import write_safetensors

OLD = {"w": torch.full((4, 3), 1.0), "extra.weight": torch.zeros(100)}  # two files, one only in the old
NEW = {"w": torch.full((4, 3), 2.0)}


def save(publisher: AtomicRenamePublisher, tensors: dict[str, torch.Tensor], **kwargs) -> Path:
    """What a one-rank save does: prepare, write every file and the index, finalize."""
    temporary = publisher.prepare()
    save_checkpoint(temporary, tensors, max_shard_bytes=64)
    return publisher.finalize(**kwargs)


def value_of(path: Path) -> float:
    with CheckpointReader(path) as reader:
        return float(reader.read("w")[0, 0])


def siblings(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_names_and_protocol(tmp_path) -> None:
    publisher = AtomicRenamePublisher(tmp_path / "hf-100")
    assert publisher.final == tmp_path / "hf-100"
    assert publisher.temporary == tmp_path / ".hf-100.incomplete" == temporary_path(tmp_path / "hf-100")
    assert isinstance(publisher, Publisher)
    assert is_temporary_path(publisher.temporary) and not is_temporary_path(publisher.final)
    assert not is_temporary_path(tmp_path / ".incomplete")
    assert repr(publisher) == f"AtomicRenamePublisher(final={str(tmp_path / 'hf-100')!r})"


def test_publish_new_path(tmp_path) -> None:
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = publisher.prepare()
    assert temporary.is_dir() and [p.name for p in temporary.iterdir()] == [MARKER_NAME]  # only its owner
    assert not (tmp_path / "ckpt").exists()  # nothing is visible before finalize
    save_checkpoint(temporary, OLD, max_shard_bytes=64)
    assert not is_complete(tmp_path / "ckpt")
    assert publisher.finalize() == tmp_path / "ckpt"
    assert siblings(tmp_path) == ["ckpt"]  # no temporary left
    assert is_complete(tmp_path / "ckpt") and validate_final(tmp_path / "ckpt") == []
    assert value_of(tmp_path / "ckpt") == 1.0


@pytest.mark.parametrize("use_exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replace_existing(tmp_path, use_exchange) -> None:
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    old_files = set(read_checkpoint(tmp_path / "ckpt").files)
    assert len(old_files) == 2
    save(AtomicRenamePublisher(tmp_path / "ckpt", use_exchange=use_exchange), NEW)
    assert siblings(tmp_path) == ["ckpt"]  # no temporary, no old copy left aside
    assert value_of(tmp_path / "ckpt") == 2.0
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["model-00001-of-00001.safetensors", INDEX_NAME]  # old content gone, not merged
    assert is_complete(tmp_path / "ckpt")


def test_exchange_is_available_here(tmp_path) -> None:
    """On Linux the replace really is one renameat2 swap (skipped where the filesystem refuses it)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "in_a").write_text("a")
    if not exchange_paths(tmp_path / "a", tmp_path / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this system")
    assert (tmp_path / "b" / "in_a").exists() and not (tmp_path / "a" / "in_a").exists()
    with pytest.raises(FileNotFoundError):
        exchange_paths(tmp_path / "a", tmp_path / "missing")


def exchange_supported(tmp_path: Path) -> bool:
    (tmp_path / "probe-a").mkdir()
    (tmp_path / "probe-b").mkdir()
    try:
        return exchange_paths(tmp_path / "probe-a", tmp_path / "probe-b")
    finally:
        (tmp_path / "probe-a").rmdir()
        (tmp_path / "probe-b").rmdir()


def test_replace_uses_exchange_not_rename_aside(tmp_path, monkeypatch) -> None:
    if not exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this system")
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def recording_rename(a, b):
        renames.append((str(a), str(b)))
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", recording_rename)
    save(AtomicRenamePublisher(tmp_path / "ckpt"), NEW)
    assert not any(b == str(tmp_path / "ckpt") for _, b in renames)  # never a moment without `ckpt`
    assert value_of(tmp_path / "ckpt") == 2.0


def test_abort_keeps_the_old_checkpoint(tmp_path) -> None:
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = publisher.prepare()
    save_checkpoint(temporary, NEW)
    publisher.abort()
    publisher.abort()  # twice is fine
    assert siblings(tmp_path) == ["ckpt"]
    assert value_of(tmp_path / "ckpt") == 1.0 and is_complete(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"nothing to publish .* call prepare\(\) first"):
        publisher.finalize()


def test_prepare_refuses_a_file(tmp_path) -> None:
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointError) as info:
        AtomicRenamePublisher(tmp_path / "ckpt").prepare()
    assert f"cannot save to {tmp_path / 'ckpt'}: it exists and is a file" in str(info.value)
    assert (tmp_path / "ckpt").read_text() == "not a directory"
    assert siblings(tmp_path) == ["ckpt"]


def test_prepare_refuses_a_missing_parent(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=f"parent directory {tmp_path / 'no' / 'such'} does not exist"):
        AtomicRenamePublisher(tmp_path / "no" / "such" / "ckpt").prepare()


def test_prepare_refuses_a_read_only_parent(tmp_path, monkeypatch) -> None:
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: ask access() what an ordinary user would be told
        monkeypatch.setattr(publish_module.os, "access", lambda path, mode: False)
    try:
        with pytest.raises(CheckpointError, match=f"parent directory {tmp_path / 'ro'} is not writable"):
            AtomicRenamePublisher(tmp_path / "ro" / "ckpt").prepare()
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert not (tmp_path / "ro" / ".ckpt.incomplete").exists()


def test_prepare_removes_a_stale_temporary(tmp_path) -> None:
    stale = tmp_path / ".ckpt.incomplete"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    temporary = AtomicRenamePublisher(tmp_path / "ckpt").prepare()
    assert temporary == stale and [p.name for p in temporary.iterdir()] == [MARKER_NAME]


def test_finalize_refuses_a_damaged_save(tmp_path) -> None:
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = publisher.prepare()
    save_checkpoint(temporary, NEW)
    (temporary / "model-00001-of-00001.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{")  # a rank's write broke
    with pytest.raises(CheckpointError) as info:
        publisher.finalize()
    assert f"refusing to publish {temporary} as {tmp_path / 'ckpt'}" in str(info.value)
    assert "truncated file" in str(info.value)
    assert value_of(tmp_path / "ckpt") == 1.0  # untouched
    assert temporary.is_dir()  # kept for inspection


def test_finalize_without_verification_publishes_any_directory(tmp_path) -> None:
    publisher = AtomicRenamePublisher(tmp_path / "dcp")
    (publisher.prepare() / ".metadata").write_bytes(b"dcp")
    assert publisher.finalize(verify=False) == tmp_path / "dcp"
    assert (tmp_path / "dcp" / ".metadata").read_bytes() == b"dcp"


def test_finalize_fsyncs_every_file_and_directory(tmp_path, monkeypatch) -> None:
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = publisher.prepare()
    save_checkpoint(temporary, OLD, max_shard_bytes=64)
    (temporary / "config").mkdir()
    (temporary / "config" / "config.json").write_text("{}")
    files: list[str] = []
    dirs: list[str] = []
    monkeypatch.setattr(publish_module, "fsync_file", lambda p: files.append(os.path.basename(p)))
    monkeypatch.setattr(publish_module, "fsync_dir", lambda p: dirs.append(str(p)))
    publisher.finalize()
    assert sorted(files) == sorted(
        [INDEX_NAME, "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    assert dirs[:2] == [str(temporary / "config"), str(temporary)]  # deepest first, before publishing
    assert dirs[-1] == str(tmp_path)  # the parent, after the rename


def test_a_failed_prepare_leaves_no_directory_that_looks_live(tmp_path, monkeypatch) -> None:
    """The rename made ``.ckpt.incomplete`` (with this process's live marker), then the parent's fsync failed: the
    directory used to stay, and every other process's save to the path was refused as "in progress" for 5 minutes."""
    def broken_fsync(path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(publish_module, "fsync_dir", broken_fsync)
    with pytest.raises(CheckpointError, match=r"cannot create the temporary directory .*Input/output error"):
        AtomicRenamePublisher(tmp_path / "ckpt").prepare()
    assert siblings(tmp_path) == []
    monkeypatch.undo()
    assert AtomicRenamePublisher(tmp_path / "ckpt").prepare() == tmp_path / ".ckpt.incomplete"


CRASH = textwrap.dedent(
    """
    import os, sys, torch
    from pathlib import Path
    from tests.io.support import save_checkpoint
    from workbench.io.files.publish import AtomicRenamePublisher

    publisher = AtomicRenamePublisher(Path(sys.argv[1]))
    save_checkpoint(publisher.prepare(), {"w": torch.full((4, 3), 2.0)})
    os._exit(9)  # killed after every file is written, before finalize
    """
)


def test_crash_before_finalize_keeps_the_old_checkpoint(tmp_path) -> None:
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path / "ckpt")], cwd=root, check=False)
    assert result.returncode == 9
    temporary = tmp_path / ".ckpt.incomplete"
    assert (temporary / INDEX_NAME).is_file()  # the new save got as far as it could
    assert value_of(tmp_path / "ckpt") == 1.0
    assert is_complete(tmp_path / "ckpt")
    assert not is_complete(temporary)  # complete content, but never published
    assert validate_final(temporary) == [
        f"{temporary}: an unpublished save (a '.incomplete' directory): finalize() never ran on it"
    ]
    # the next save starts clean and publishes
    save(AtomicRenamePublisher(tmp_path / "ckpt"), NEW)
    assert value_of(tmp_path / "ckpt") == 2.0 and siblings(tmp_path) == ["ckpt"]


def test_crash_inside_the_fallback_window_is_repaired(tmp_path, monkeypatch) -> None:
    """rename-aside: a crash after moving the old checkpoint aside loses nothing; prepare() puts it back."""
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    publisher = AtomicRenamePublisher(tmp_path / "ckpt", use_exchange=False)
    save_checkpoint(publisher.prepare(), NEW)
    real_rename = os.rename

    def crash_on_second_rename(a, b):
        if Path(a) == publisher.temporary:
            raise OSError(5, "simulated crash")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", crash_on_second_rename)
    with pytest.raises(CheckpointError, match=r"publishing .* failed: .*simulated crash"):
        publisher.finalize()
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "ckpt").exists() and is_complete(tmp_path / ".ckpt.old")
    problems = validate_final(tmp_path / "ckpt")
    assert "does not exist" in problems[0] and "moved aside to" in problems[0] and ".ckpt.incomplete" in problems[0]
    AtomicRenamePublisher(tmp_path / "ckpt").prepare()  # the next save repairs first
    assert value_of(tmp_path / "ckpt") == 1.0 and not (tmp_path / ".ckpt.old").exists()


def test_leftover_aside_is_removed_when_final_exists(tmp_path) -> None:
    save(AtomicRenamePublisher(tmp_path / "ckpt"), NEW)
    (tmp_path / ".ckpt.old").mkdir()  # a crash after the publish, before the delete
    AtomicRenamePublisher(tmp_path / "ckpt").prepare()
    assert siblings(tmp_path) == [".ckpt.incomplete", "ckpt"]
    assert value_of(tmp_path / "ckpt") == 2.0


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        # no index: the save never got to its last step
        (lambda d: (d / INDEX_NAME).unlink(), f"no {INDEX_NAME}: every workbench checkpoint has one"),
        # a shard of the weight map is gone
        (lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "missing file"),
        # total_size disagrees with the headers
        (
            lambda d: edit_index(d, lambda b: b["metadata"].update(total_size=5)),
            "size mismatch: metadata.total_size is 5 bytes but the 2 keys of the weight_map hold 448 bytes",
        ),
        # an index from another tool, without total_size
        (lambda d: edit_index(d, lambda b: b.update(metadata={})), "no metadata.total_size"),
        # a header cut short
        (
            lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(
                (d / "model-00001-of-00002.safetensors").read_bytes()[:20]
            ),
            "truncated file",
        ),
    ],
)
def test_validate_final_finds_damage(tmp_path, damage, fragment) -> None:
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    assert is_complete(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    problems = validate_final(tmp_path / "ckpt")
    assert any(fragment in p for p in problems), problems
    assert not is_complete(tmp_path / "ckpt")


def test_validate_final_on_odd_paths(tmp_path) -> None:
    assert validate_final(tmp_path / "nope") == [f"{tmp_path / 'nope'}: does not exist"]
    (tmp_path / "file").write_text("x")
    assert "not a directory" in validate_final(tmp_path / "file")[0]
    (tmp_path / "single").mkdir()
    write_safetensors(tmp_path / "single" / "model.safetensors", {"w": torch.zeros(1)})
    assert read_checkpoint(tmp_path / "single").keys  # readable, but not a workbench checkpoint
    assert not is_complete(tmp_path / "single")


def test_abort_without_prepare_leaves_another_saves_live_directory(tmp_path) -> None:
    """Only the publisher that prepared a temporary may remove it while it is live: a second publisher of the same
    path, in this process, that never prepared, aborts without touching it."""
    holder = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = holder.prepare()
    AtomicRenamePublisher(tmp_path / "ckpt").abort()
    assert [p.name for p in temporary.iterdir()] == [MARKER_NAME]
    save_checkpoint(temporary, NEW)
    assert holder.finalize() == tmp_path / "ckpt" and value_of(tmp_path / "ckpt") == 2.0


def test_a_failed_finalize_lets_go_and_abort_removes_the_leftover(tmp_path) -> None:
    """After a refused publish the save is over: the directory (kept for inspection) is no longer held live, so
    clean_incomplete may remove it; abort does."""
    from workbench.io.files.ownership import claimed_here, incomplete_save

    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = publisher.prepare()
    assert claimed_here(temporary) and incomplete_save(temporary).live
    with pytest.raises(CheckpointError, match="refusing to publish"):
        publisher.finalize()  # no index: never a checkpoint
    assert temporary.is_dir() and not claimed_here(temporary)
    assert not incomplete_save(temporary).live
    publisher.abort()
    assert siblings(tmp_path) == []


def test_the_owner_marker_stays_until_the_directory_is_published(tmp_path, monkeypatch) -> None:
    """Another process judges a temporary without its marker a dead save's and deletes it: the marker used to go
    before the publishing rename, and a clean_incomplete in that gap removed the save being published."""
    from workbench.io.files.ownership import read_owner

    seen = {}

    def at(name: str, rank: int) -> None:
        if name == "rename":  # the moment before the publishing rename
            temporary = tmp_path / ".ckpt.incomplete"
            owner = read_owner(temporary)
            seen["marker"] = (temporary / MARKER_NAME).exists()
            seen["live to another process"] = owner is not None and owner.stale_reason() is None  # a fresh beat

    monkeypatch.setattr(publish_module, "fault_point", at)
    save(AtomicRenamePublisher(tmp_path / "ckpt"), OLD)
    save(AtomicRenamePublisher(tmp_path / "ckpt"), NEW)  # the exchange too
    assert seen == {"marker": True, "live to another process": True}
    assert siblings(tmp_path) == ["ckpt"] and MARKER_NAME not in os.listdir(tmp_path / "ckpt")
    assert value_of(tmp_path / "ckpt") == 2.0


def test_a_target_that_stopped_being_a_checkpoint_while_saving_is_not_replaced(tmp_path) -> None:
    """'Only a checkpoint is replaced' holds at the publish too: a job that wrote into the (empty) target while an
    async save ran lost what it wrote."""
    final = tmp_path / "run"
    final.mkdir()
    publisher = AtomicRenamePublisher(final)
    temporary = publisher.prepare()
    save_checkpoint(temporary, NEW, max_shard_bytes=64)
    (final / "step-200").mkdir()
    (final / "step-200" / "notes.txt").write_text("important")
    with pytest.raises(CheckpointError, match=r"while the save ran it became a directory that is not a checkpoint"):
        publisher.finalize()
    assert (final / "step-200" / "notes.txt").read_text() == "important"
    publisher.abort()
    assert siblings(tmp_path) == ["run"]


@pytest.mark.parametrize("name", [".ckpt.incomplete", ".ckpt.old", ".ckpt.incomplete.123-7f.staging"])
def test_a_temporary_name_is_refused_as_a_target(tmp_path, name) -> None:
    """Saving to another save's temporary directory swapped the live directory out and deleted it."""
    with pytest.raises(CheckpointError, match="the name of a save's temporary directory"):
        AtomicRenamePublisher(tmp_path / name)


def test_a_relative_target_stays_where_it_was_named(tmp_path, monkeypatch) -> None:
    """The writes and the publish of an async save run after the call: a relative path named another place once
    the working directory changed."""
    monkeypatch.chdir(tmp_path)
    publisher = AtomicRenamePublisher("ckpt")
    assert publisher.final == tmp_path / "ckpt"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    save(publisher, NEW)
    assert siblings(tmp_path) == ["ckpt", "elsewhere"] and value_of(tmp_path / "ckpt") == 2.0
