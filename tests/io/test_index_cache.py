"""``cached_checkpoint``: a parsed index is reused only while no file of its checkpoint changed.

The expected index after each change comes from parsing the files afresh (``read_checkpoint``), and the loads
read back the tensors written, so a stale cache shows as a wrong shape or wrong values.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.io.support import save_checkpoint, small_model
from workbench.errors import CheckpointError
from workbench.io.files import index as index_module
from workbench.io.files.index import INDEX_NAME, cached_checkpoint, read_checkpoint
from workbench.io.files.read import CheckpointReader


@pytest.fixture(autouse=True)
def settled(monkeypatch):
    """Files written by the test count as settled at once (else the first parse is never cached), and every test
    starts with an empty cache."""
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())


@pytest.fixture
def ckpt(tmp_path) -> Path:
    tensors = small_model()
    writers = {k: (0 if i < 3 else 1) for i, k in enumerate(tensors)}
    save_checkpoint(tmp_path / "ckpt", tensors, writers)
    return tmp_path / "ckpt"


def _parses(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = index_module.read_checkpoint

    def counting(path):
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(index_module, "read_checkpoint", counting)
    return calls


def test_an_unchanged_checkpoint_is_parsed_once(ckpt, monkeypatch) -> None:
    parses = _parses(monkeypatch)
    first = cached_checkpoint(ckpt)
    assert cached_checkpoint(ckpt) is first
    assert cached_checkpoint(str(ckpt) + "/") is first  # the same folder, spelled otherwise
    assert len(parses) == 1
    assert first.keys == read_checkpoint(ckpt).keys


def _replace_file(ckpt: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as a checkpoint elsewhere and move its one file over ``name`` (a new inode)."""
    other = ckpt.parent / "other"
    save_checkpoint(other, tensors)
    (other / sorted(p.name for p in other.glob("*.safetensors"))[0]).replace(ckpt / name)
    shutil.rmtree(other)


def test_a_replaced_file_is_parsed_again(ckpt, monkeypatch) -> None:
    parses = _parses(monkeypatch)
    old = cached_checkpoint(ckpt)
    key = "model.embed_tokens.weight"
    name = old.keys[key].file
    keep = {k: torch.zeros(old.keys[k].shape, dtype=torch.float32) for k, f in old.weight_map.items() if f == name}
    keep[key] = torch.arange(40, dtype=torch.float32).reshape(10, 4)  # another shape and dtype
    _replace_file(ckpt, name, keep)
    new = cached_checkpoint(ckpt)
    assert len(parses) == 2
    assert new.keys[key].shape == (10, 4) and new.keys[key].dtype == "F32"
    with CheckpointReader(ckpt) as reader:
        assert torch.equal(reader.read(key), keep[key])


def test_a_file_rewritten_in_place_is_parsed_again(ckpt, monkeypatch) -> None:
    """Same inode, same size: the change time tells."""
    parses = _parses(monkeypatch)
    old = cached_checkpoint(ckpt)
    path = old.path_of(old.files[0])
    data, before = path.read_bytes(), path.stat()
    with open(path, "r+b") as f:  # the same bytes written again
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the modification time set back: only the
    assert path.stat().st_mtime_ns == before.st_mtime_ns  # change time tells
    cached_checkpoint(ckpt)
    assert len(parses) == 2


def test_a_changed_index_is_parsed_again(ckpt, monkeypatch) -> None:
    old = cached_checkpoint(ckpt)
    dropped = next(iter(old.keys))
    index_file = ckpt / INDEX_NAME
    text = index_file.read_text()
    import json

    body = json.loads(text)
    del body["weight_map"][dropped]
    index_file.write_text(json.dumps(body))
    new = cached_checkpoint(ckpt)
    assert dropped not in new.keys and set(new.keys) == set(old.keys) - {dropped}


def test_a_deleted_file_is_an_error_not_a_cached_index(ckpt) -> None:
    old = cached_checkpoint(ckpt)
    old.path_of(old.files[-1]).unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        cached_checkpoint(ckpt)


def test_a_truncated_file_is_an_error_not_a_cached_index(ckpt) -> None:
    old = cached_checkpoint(ckpt)
    path = old.path_of(old.files[0])
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CheckpointError, match=r"truncated|past the end|beyond"):
        cached_checkpoint(ckpt)


def test_a_recently_changed_checkpoint_is_not_kept(ckpt, monkeypatch) -> None:
    """A file that changed just before parsing may still be changing: it is parsed again next time."""
    monkeypatch.setattr(index_module, "_SETTLED_NS", 3600 * 10**9)
    parses = _parses(monkeypatch)
    cached_checkpoint(ckpt)
    cached_checkpoint(ckpt)
    assert len(parses) == 2


def test_the_cache_keeps_a_bounded_number_of_checkpoints(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(index_module, "_CACHE_SIZE", 2)
    folders = []
    for i in range(3):
        save_checkpoint(tmp_path / f"c{i}", {"w": torch.full((2,), float(i))})
        folders.append(tmp_path / f"c{i}")
    for folder in folders:
        cached_checkpoint(folder)
    assert list(index_module._cache) == [folders[1].absolute(), folders[2].absolute()]


def test_a_path_through_a_link_and_dotdot_is_the_one_the_system_opens(tmp_path: Path) -> None:
    """``link/../ckpt`` is ``real/ckpt`` when ``link`` points at ``real/sub``, not ``./ckpt``: the cache keeps the
    path as given (``os.path.abspath`` would drop ``link/..`` as text)."""
    save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(2)})
    save_checkpoint(tmp_path / "real" / "ckpt", {"w": torch.zeros(5)})
    (tmp_path / "real" / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    spelled = tmp_path / "link" / ".." / "ckpt"
    assert read_checkpoint(spelled).keys["w"].shape == (5,)
    assert cached_checkpoint(spelled).keys["w"].shape == (5,)
    assert cached_checkpoint(tmp_path / "ckpt").keys["w"].shape == (2,)
    with CheckpointReader(spelled) as reader:
        assert reader.read("w").shape == (5,)
