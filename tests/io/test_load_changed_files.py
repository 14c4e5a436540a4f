"""A checkpoint changed under a load: another save publishes at the same path, or a file is rewritten in place, while
``load_hf`` reads it. The index (with every tensor's offsets) is parsed once; reading a file opened after it changed
applied the old offsets to the new bytes, and the load succeeded with tensors mixed from two checkpoints (or each
holding the other's values). Every case here must fail the load, naming the file."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.errors import CheckpointError
from workbench.faults import fault_hook
from workbench.io.files.read import CheckpointReader


def _write(path: Path, items: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file of float32 ``items``, in that order, written by hand (not by the code under test)."""
    header, offset, blobs = {}, 0, []
    for key, t in items:
        n = t.numel() * 4
        header[key] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
        blobs.append(t.numpy().tobytes())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _checkpoint(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    folder.mkdir()
    a = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    tensors = {"a": a, "b": -a - 1}
    file = folder / "model.safetensors"
    _write(file, list(tensors.items()))
    old = time.time() - 5  # settled: the parsed index may be kept (index.py keeps none changed within a second)
    os.utime(file, (old, old))
    return tensors, file


def _load_while(folder: Path, point: str, change: Callable[[], None], ran: list[str],
                targets: dict[str, torch.Tensor] | None = None) -> wb.LoadReport:
    """``load_hf`` of ``folder`` into ``targets`` (zeros by default), calling ``change`` once at fault point
    ``point`` (noted in ``ran``)."""

    def hook(where: str, rank: int, detail: object) -> None:
        if where == point and not ran:
            ran.append(where)
            change()

    targets = {k: torch.zeros(64, 64) for k in ("a", "b")} if targets is None else targets
    with fault_hook(hook):
        return wb.load_hf(targets, folder, read_direct=False)


@pytest.mark.parametrize("point", ["load.planned", "load.read"])
def test_a_file_replaced_during_a_load_fails_it(tmp_path: Path, point: str) -> None:
    tensors, file = _checkpoint(tmp_path / "ckpt")
    swapped = [("b", tensors["b"] + 1000), ("a", tensors["a"] + 1000)]  # same keys and shapes, other file order

    def replace() -> None:
        _write(file.with_name(".next"), swapped)
        os.replace(file.with_name(".next"), file)  # what a save's publish does: a new file at the same path

    ran: list[str] = []
    with pytest.raises(wb.LoadFailed, match="replaced by another file since its header"):
        _load_while(tmp_path / "ckpt", point, replace, ran)
    assert ran


def test_a_file_rewritten_in_place_while_it_is_read_fails_the_load(tmp_path: Path) -> None:
    _, file = _checkpoint(tmp_path / "ckpt")

    def rewrite() -> None:  # the file is open and being read: its bytes change under it
        with open(file, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(struct.pack("<f", 12345.0))

    ran: list[str] = []
    with pytest.raises(wb.LoadFailed, match="rewritten in place since its header"):
        _load_while(tmp_path / "ckpt", "load.read", rewrite, ran)
    assert ran


def test_an_unchanged_checkpoint_loads_and_a_settled_repeat_load_reuses_its_index(tmp_path: Path) -> None:
    tensors, _ = _checkpoint(tmp_path / "ckpt")
    for _ in range(2):
        targets = {k: torch.zeros(64, 64) for k in tensors}
        assert wb.load_hf(targets, tmp_path / "ckpt", read_direct=False).ok
        assert all(torch.equal(targets[k], v) for k, v in tensors.items())


def test_a_hard_link_or_chmod_of_a_file_during_a_load_changes_no_byte_and_fails_nothing(tmp_path: Path) -> None:
    # rsync --link-dest, cp -al and dedup tools link checkpoint files while jobs read them: the change time moves,
    # the bytes do not
    tensors, file = _checkpoint(tmp_path / "ckpt")

    def touch_metadata() -> None:
        os.link(file, tmp_path / "backup.safetensors")
        os.chmod(file, 0o444)

    ran: list[str] = []
    targets = {k: torch.zeros(64, 64) for k in tensors}
    assert _load_while(tmp_path / "ckpt", "load.read", touch_metadata, ran, targets).ok and ran
    assert all(torch.equal(targets[k], v) for k, v in tensors.items())


def test_the_checkpoint_reader_refuses_a_file_replaced_after_its_index_was_parsed(tmp_path: Path) -> None:
    tensors, file = _checkpoint(tmp_path / "ckpt")
    with CheckpointReader(tmp_path / "ckpt") as reader:
        _write(file.with_name(".next"), [("b", tensors["b"]), ("a", tensors["a"])])
        os.replace(file.with_name(".next"), file)
        with pytest.raises(CheckpointError, match="replaced by another file since its header was read"):
            reader.read("a")


def test_a_save_published_while_the_index_is_parsed_fails_that_load_only(tmp_path: Path, monkeypatch) -> None:
    """Another save swaps in its folder right after this load parsed the headers: that load is refused, and the next
    one loads the new checkpoint. The files of a swapped folder keep their own (old) change times, so an index of
    the old files was kept beside a signature of the new ones, and every later load in the process was refused."""
    from workbench.io.files import index as index_module
    from workbench.io.files.publish import exchange_paths

    tensors, _ = _checkpoint(tmp_path / "ckpt")
    newer = tmp_path / "next"
    newer.mkdir()
    _write(newer / "model.safetensors", [("b", tensors["b"] + 1000), ("a", tensors["a"] + 1000)])
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))  # every file counts as settled (no 1 s wait)
    real = index_module.read_checkpoint
    swapped: list[bool] = []

    def parse_then_publish(path):
        parsed = real(path)
        if not swapped:
            swapped.append(exchange_paths(newer, tmp_path / "ckpt"))
        return parsed

    monkeypatch.setattr(index_module, "read_checkpoint", parse_then_publish)
    with pytest.raises(wb.LoadFailed, match="replaced by another file since its header"):
        wb.load_hf({k: torch.zeros(64, 64) for k in tensors}, tmp_path / "ckpt", read_direct=False)
    assert swapped == [True]
    for _ in range(2):
        targets = {k: torch.zeros(64, 64) for k in tensors}
        assert wb.load_hf(targets, tmp_path / "ckpt", read_direct=False).ok
        assert all(torch.equal(targets[k], v + 1000) for k, v in tensors.items())


def test_the_checkpoint_reader_refuses_a_file_rewritten_in_place_after_it_was_opened(tmp_path: Path) -> None:
    """The file was opened (and checked) for the first key; another save then rewrote it in place, as
    ``safetensors.save_file`` does. A memory map of it read the new bytes at the old offsets, without a word."""
    tensors, file = _checkpoint(tmp_path / "ckpt")
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert torch.equal(reader.read("a"), tensors["a"])
        _write(file, [("b", tensors["b"] + 1000), ("a", tensors["a"] + 1000)])
        with pytest.raises(CheckpointError, match="rewritten in place since its header"):
            reader.read("b")


def test_the_checkpoint_reader_survives_a_file_truncated_under_it(tmp_path: Path) -> None:
    """In a process of its own: a memory-mapped read of a truncated file dies of SIGBUS."""
    import subprocess
    import sys

    _checkpoint(tmp_path / "ckpt")
    code = (
        "import sys\n"
        "from workbench.errors import CheckpointError\n"
        "from workbench.io.files.read import CheckpointReader\n"
        f"r = CheckpointReader({str(tmp_path / 'ckpt')!r})\n"
        "r.read('a')\n"
        f"open({str(tmp_path / 'ckpt' / 'model.safetensors')!r}, 'r+b').truncate(200)\n"
        "try:\n"
        "    r.read('b')\n"
        "except CheckpointError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "model.safetensors" in done.stdout
