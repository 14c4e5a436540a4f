"""The streaming safetensors writer writes what safetensors reads, byte for byte like save_file."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from workbench.errors import CheckpointError
from workbench.io.files.index import read_header
from workbench.io.files.stream_write import StreamWriter

TENSORS = {
    "z.bf16": torch.randn(3, 5).to(torch.bfloat16),  # narrow dtype first in plan order: must move after f32
    "a.f32": torch.randn(4, 2),
    "m.i64": torch.arange(7),
    "b.bool": torch.tensor([True, False, True]),
    "e.empty": torch.empty(0, 3),
    "s.scalar": torch.tensor(2.5, dtype=torch.float16),
}


def test_matches_save_file_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "stream.safetensors"
    entries = [(k, t.dtype, tuple(t.shape)) for k, t in TENSORS.items()]
    writer = StreamWriter(path, entries, {"format": "pt"})
    threads = [threading.Thread(target=writer.write, args=(k, t)) for k, t in reversed(TENSORS.items())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.close() == path.stat().st_size
    loaded = load_file(path)
    assert loaded.keys() == TENSORS.keys()
    assert all(loaded[k].dtype == t.dtype and torch.equal(loaded[k], t) for k, t in TENSORS.items())
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_slice("a.f32")[1:3], TENSORS["a.f32"][1:3])
    keys, _, problems = read_header(path)
    assert not problems and set(keys) == set(TENSORS)
    reference = tmp_path / "ref.safetensors"
    save_file(TENSORS, reference, metadata={"format": "pt"})
    assert path.read_bytes() == reference.read_bytes()  # the same bytes as safetensors' own writer


def test_incomplete_file_and_bad_writes_are_errors(tmp_path: Path) -> None:
    writer = StreamWriter(tmp_path / "x.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
    writer.write("a", torch.ones(2))
    with pytest.raises(CheckpointError, match="written twice"):
        writer.write("a", torch.ones(2))
    with pytest.raises(CheckpointError, match=r"'b' is torch.float64 \(3,\), the header says torch.float32"):
        writer.write("b", torch.ones(3, dtype=torch.float64))
    with pytest.raises(CheckpointError, match="not in this file's header"):
        writer.write("c", torch.ones(1))
    with pytest.raises(CheckpointError, match=r"1 key\(s\) never written, e.g. \('b',\); the file is incomplete"):
        writer.close()
