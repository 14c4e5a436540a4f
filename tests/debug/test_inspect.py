"""inspect_checkpoint: header summaries and integrity findings, one broken checkpoint per integrity kind."""

from __future__ import annotations

import functools
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.debug.corpus import edit_index, first_file, model, write
from workbench.debug import inspect_checkpoint
from workbench.io.files.index import INDEX_NAME


def _experts() -> dict[str, torch.Tensor]:
    t = {f"model.layers.{i}.mlp.experts.{e}.w1.weight": torch.zeros(2, 3, dtype=torch.bfloat16)
         for i in range(4) for e in range(3)}
    t["model.norm.weight"] = torch.ones(5)
    return t


def test_summary_groups_keys_and_counts(tmp_path) -> None:
    path = write(tmp_path / "ck", _experts(), max_shard_bytes=40, metadata={"layout": "abc123", "format": "pt"})
    ins = inspect_checkpoint(path)
    assert ins.ok and ins.exit_status == 0 and ins.format == "hf"
    groups = {g.pattern: g for g in ins.groups}
    g = groups["model.layers.{0..3}.mlp.experts.{0..2}.w1.weight"]
    assert (g.count, g.shapes, g.dtypes, g.params, g.nbytes) == (12, ((2, 3),), ("BF16",), 72, 144)
    assert groups["model.norm.weight"].params == 5
    assert ins.num_keys == 13 and ins.params == 77 and ins.nbytes == 144 + 20
    assert sum(f.nbytes for f in ins.files) == 164 and len(ins.files) == len(list(path.glob("*.safetensors")))
    assert all(f.file_bytes == (path / f.name).stat().st_size for f in ins.files)
    assert ins.layout_fingerprint == "abc123"
    assert ins.dtypes == {"BF16": 12, "F32": 1}
    text = ins.to_text()
    assert "model.layers.{0..3}.mlp.experts.{0..2}.w1.weight" in text and "integrity: ok" in text
    assert "<table" in ins._repr_html_()
    json.dumps(ins.to_dict())


def test_single_file_and_gappy_numbers(tmp_path) -> None:
    tensors = {f"layers.{i}.w": torch.zeros(1) for i in (0, 1, 2, 5, 7)}
    save_file(tensors, str(tmp_path / "one.safetensors"))
    ins = inspect_checkpoint(tmp_path / "one.safetensors")
    assert ins.format == "safetensors" and ins.ok
    assert [g.pattern for g in ins.groups] == ["layers.{0..2,5,7}.w"]


def _kinds(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in inspect_checkpoint(path).findings:
        out.setdefault(f.kind, set()).add(f.key)
    return out


def test_header_claiming_100_gb_is_corrupt_header(tmp_path) -> None:
    path = write(tmp_path / "ck", model())
    victim = first_file(path)
    with open(victim, "r+b") as f:
        f.write(struct.pack("<Q", 100 * 10**9))
    ins = inspect_checkpoint(path)
    assert any(f.kind == "corrupt_header" and f.key == victim.name for f in ins.findings), ins.to_text()
    assert ins.exit_status == 1


def test_truncated_file(tmp_path) -> None:
    path = write(tmp_path / "ck", model())
    victim = first_file(path)
    os.truncate(victim, victim.stat().st_size - 10)
    assert victim.name in _kinds(path)["truncated_file"]


def test_index_naming_a_missing_file_and_a_stale_total(tmp_path) -> None:
    path = write(tmp_path / "ck", model())
    edit_index(path, lambda b: b["weight_map"].__setitem__("ghost.weight", "model-00009-of-00009.safetensors"))
    assert "model-00009-of-00009.safetensors" in _kinds(path)["index_inconsistent"]
    path2 = write(tmp_path / "ck2", model())
    edit_index(path2, lambda b: b["metadata"].__setitem__("total_size", 1))
    assert _kinds(path2) == {"index_inconsistent": {INDEX_NAME}}


def test_key_in_header_but_not_in_index(tmp_path) -> None:
    path = write(tmp_path / "ck", model())
    edit_index(path, lambda b: b["weight_map"].pop("lm_head.weight"))
    kinds = _kinds(path)
    assert "lm_head.weight" in kinds["index_inconsistent"]


def test_safetensors_files_the_index_does_not_name_are_findings(tmp_path) -> None:
    # a stale single-file save beside a sharded one: transformers reads model.safetensors before the index, so the
    # folder loads the stale weights, and the old inspect said "integrity: ok"; a leftover shard of an older save
    path = write(tmp_path / "ck", model(), writers={k: i % 2 for i, k in enumerate(model())})
    assert (path / INDEX_NAME).is_file() and not _kinds(path)
    stale = model(seed=1)
    save_file(stale, str(path / "model.safetensors"))
    save_file({"model.norm.weight": stale["model.norm.weight"]}, str(path / "model-00003-of-00003.safetensors"))
    ins = inspect_checkpoint(path)
    assert _kinds(path) == {"index_inconsistent": {"model.safetensors", "model-00003-of-00003.safetensors"}}
    text = ins.to_text()
    assert "transformers loads model.safetensors before the index" in text and "integrity: ok" not in text, text
    assert ins.exit_status == 1


def test_index_paths_never_escape_the_folder(tmp_path) -> None:
    outside = tmp_path / "secret.safetensors"
    save_file({"stolen": torch.zeros(3)}, str(outside))
    path = write(tmp_path / "ck", model())
    (path / "link.safetensors").symlink_to(outside)
    edit_index(path, lambda b: b["weight_map"].update({"a.x": "../secret.safetensors", "b.y": str(outside),
                                                       "c.z": "link.safetensors"}))
    ins = inspect_checkpoint(path)
    bad = {f.key for f in ins.findings if f.kind == "index_inconsistent"}
    assert bad == {"../secret.safetensors", str(outside), "link.safetensors"}
    assert all("stolen" not in g.pattern for g in ins.groups)
    assert ins.num_keys == len(model())  # the rest is still read


def test_incomplete_saves(tmp_path) -> None:
    path = write(tmp_path / "ck", model())
    (tmp_path / ".ck.incomplete").mkdir()
    assert _kinds(path) == {"incomplete_checkpoint": {""}}
    temporary = write(tmp_path / ".other.incomplete", model())
    assert "incomplete_checkpoint" in _kinds(temporary)


def test_missing_path_is_unreadable(tmp_path) -> None:
    ins = inspect_checkpoint(tmp_path / "nope")
    assert ins.exit_status == 2 and "does not exist" in ins.error
    (tmp_path / "empty").mkdir()
    assert inspect_checkpoint(tmp_path / "empty").exit_status == 2


def test_dcp_pickle_needs_opt_in(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(4, 2), "layers.0.b": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    closed = inspect_checkpoint(tmp_path / "dcp")
    assert closed.format == "dcp" and closed.num_keys == 0
    assert "pickle" in closed.notes[0] and "allow_pickle=True" in closed.notes[0]
    opened = inspect_checkpoint(tmp_path / "dcp", allow_pickle=True)
    assert opened.num_keys == 2 and opened.params == 11
    assert {g.pattern for g in opened.groups} == {"w", "layers.0.b"}


def test_a_dcp_checkpoint_with_a_short_or_missing_data_file_is_a_finding(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    dcp.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, checkpoint_id=str(path), no_dist=True)
    (data,) = sorted(p.name for p in path.glob("*.distcp"))
    full = (path / data).stat().st_size

    cli = functools.partial(_inspect_cli, path)

    healthy = inspect_checkpoint(path, allow_pickle=True)
    assert healthy.ok and healthy.exit_status == 0 and "integrity: ok" in str(healthy)
    assert cli("--allow-pickle") == 0
    # without the pickle read, nothing is known of the files: no claim, and not ok
    closed = inspect_checkpoint(path)
    assert not closed.ok and closed.exit_status == 2 and "integrity: NOT checked" in str(closed)
    assert "integrity: ok" not in str(closed) and cli() == 2

    os.truncate(path / data, 100)  # a copy cut short: every byte range the metadata reads lies past 100
    short = inspect_checkpoint(path, allow_pickle=True)
    assert [(f.kind, f.key) for f in short.findings] == [("truncated_file", data)]
    assert f"truncated file: 100 bytes, .metadata reads up to byte {full}" in short.findings[0].evidence["detail"]
    assert short.exit_status == 1 and cli("--allow-pickle") == 1
    (path / data).unlink()
    gone = inspect_checkpoint(path, allow_pickle=True)
    assert [(f.kind, f.key) for f in gone.findings] == [("index_inconsistent", data)]
    assert gone.findings[0].evidence["detail"].startswith("missing file")
    assert cli("--allow-pickle") == 1


def _inspect_cli(path: Path, *extra: str) -> int:
    """``workbench inspect PATH [extra]``'s exit status."""
    return subprocess.run([sys.executable, "-m", "workbench", "inspect", str(path), *extra],
                          capture_output=True, text=True).returncode


def _dcp_save(path: Path, tensors: dict[str, torch.Tensor], *, thread_count: int = 1) -> Path:
    """A one-process DCP save of ``tensors`` into ``path`` (``thread_count`` data files)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path), thread_count=thread_count), no_dist=True)
    return path


def test_dcp_data_files_each_named_with_a_tensor_they_hold(tmp_path) -> None:
    # two writer threads: two data files; the finding names the one removed and a tensor torch put in it
    from torch.distributed.checkpoint import FileSystemReader

    path = _dcp_save(tmp_path / "dcp", {"a": torch.randn(32, 32), "b": torch.randn(16)}, thread_count=2)
    held = {info.relative_path: index.fqn for index, info in FileSystemReader(str(path)).read_metadata()
            .storage_data.items()}
    assert len(held) == 2 and inspect_checkpoint(path, allow_pickle=True).ok
    gone = sorted(held)[1]
    (path / gone).unlink()
    ins = inspect_checkpoint(path, allow_pickle=True)
    assert [(f.kind, f.key) for f in ins.findings] == [("index_inconsistent", gone)]
    assert f"entry {held[gone]!r}" in ins.findings[0].evidence["detail"]
    # without the pickle read nothing says the file is needed: still not ok, and no claim of integrity
    closed = inspect_checkpoint(path)
    assert (closed.ok, closed.exit_status, closed.findings) == (False, 2, ())
    assert "integrity: NOT checked" in str(closed) and "integrity: ok" not in str(closed)


def test_dcp_empty_data_files_of_idle_writer_threads_are_healthy(tmp_path) -> None:
    # four writer threads, one tensor: torch leaves three empty data files, which the metadata reads nothing from
    path = _dcp_save(tmp_path / "dcp", {"w": torch.randn(8)}, thread_count=4)
    assert sorted(p.stat().st_size == 0 for p in path.glob("*.distcp")) == [False, True, True, True]
    assert inspect_checkpoint(path, allow_pickle=True).ok
    assert inspect_checkpoint(path).exit_status == 2  # not read, so not checked


@pytest.mark.parametrize("keep", [0, 0.5])
def test_a_dcp_metadata_cut_short_is_a_finding_with_or_without_the_pickle_read(tmp_path, keep: float) -> None:
    path = _dcp_save(tmp_path / "dcp", {"w": torch.randn(8, 8)})
    cut = int((path / ".metadata").stat().st_size * keep)
    os.truncate(path / ".metadata", cut)
    for ins in (inspect_checkpoint(path), inspect_checkpoint(path, allow_pickle=True)):
        assert [(f.kind, f.key) for f in ins.findings] == [("truncated_file", ".metadata")]
        assert ins.findings[0].evidence["detail"].startswith(f"truncated file: {cut} bytes")
        assert (ins.ok, ins.exit_status, ins.error) == (False, 1, "")
    if keep:
        assert _inspect_cli(path) == 1


def test_a_dcp_metadata_that_is_no_pickle_is_a_finding(tmp_path) -> None:
    path = _dcp_save(tmp_path / "dcp", {"w": torch.randn(8, 8)})
    (path / ".metadata").write_bytes(b"\xff" * 64)  # 0xff is no pickle opcode
    for ins in (inspect_checkpoint(path), inspect_checkpoint(path, allow_pickle=True)):
        assert [(f.kind, f.key) for f in ins.findings] == [("index_inconsistent", ".metadata")]
        assert "64 bytes that are not one pickle (at position 0, opcode b'\\xff' unknown)" in \
            ins.findings[0].evidence["detail"]
        assert ins.exit_status == 1


def test_every_cut_of_a_dcp_metadata_breaks_where_pickletools_says(tmp_path) -> None:
    # the whole pickle is proved by an unpickler of inert stand-ins; every prefix of it must still be found broken,
    # at the place and for the reason an opcode walk of its own gives
    import pickletools

    from workbench.debug.inspect import _pickle_break

    path = _dcp_save(tmp_path / "dcp", {f"layers.{i}.w": torch.randn(4, 2) for i in range(3)})
    whole = (path / ".metadata").read_bytes()
    cut_file = tmp_path / "cut"
    assert _pickle_break(path / ".metadata") is None
    for cut in range(len(whole)):
        cut_file.write_bytes(whole[:cut])
        with cut_file.open("rb") as stream:
            with pytest.raises(ValueError) as walked:
                for _ in pickletools.genops(stream):
                    pass
            want = (stream.tell(), str(walked.value))
        assert _pickle_break(cut_file) == want, cut


def test_a_crafted_dcp_metadata_is_walked_without_running_what_it_names(tmp_path) -> None:
    import pickle

    from workbench.debug.inspect import _pickle_break

    ran = tmp_path / "ran"

    class Crafted:
        def __reduce__(self) -> tuple:
            return os.mkdir, (str(ran),)

    path = _dcp_save(tmp_path / "dcp", {"w": torch.randn(2)})
    crafted = Crafted()
    (path / ".metadata").write_bytes(pickle.dumps({"storage_data": crafted, "x": [crafted] * 3}))
    assert _pickle_break(path / ".metadata") is None  # one whole pickle
    ins = inspect_checkpoint(path)
    assert not ran.exists() and ins.exit_status == 2, ins
    pickle.loads((path / ".metadata").read_bytes())  # what the walk did not do: the pickle runs os.mkdir
    assert ran.is_dir()


def test_a_dcp_metadata_without_storage_entries_is_not_checked(tmp_path) -> None:
    # a storage writer other than torch's file system one may leave storage_data None: no file can be checked
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    path = _dcp_save(tmp_path / "dcp", {"w": torch.randn(8, 8)})
    tensor = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([8, 8]),
                                   chunks=[])
    (path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"w": tensor}, storage_data=None)))
    ins = inspect_checkpoint(path, allow_pickle=True)
    assert (ins.num_keys, ins.findings, ins.error, ins.ok, ins.exit_status) == (1, (), "", False, 2)
    assert "storage_data is NoneType" in ins.unchecked and "integrity: NOT checked" in str(ins)


def test_an_unchecked_dcp_report_goes_to_stdout(tmp_path, capsys) -> None:
    # read but not checked is a report, not an error: stdout, with exit status 2 (an unreadable path: stderr)
    from workbench.cli import main

    path = _dcp_save(tmp_path / "dcp", {"w": torch.randn(8, 8)})
    assert main(["inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "integrity: NOT checked" in out and err == ""
    assert main(["inspect", str(tmp_path / "none")]) == 2
    out, err = capsys.readouterr()
    assert "could not be read" in err and out == ""


@pytest.mark.parametrize("n_keys", [0, 1])
def test_tiny_files(tmp_path, n_keys) -> None:
    save_file({f"k{i}": torch.zeros(0) for i in range(n_keys)}, str(tmp_path / "t.safetensors"))
    assert inspect_checkpoint(tmp_path / "t.safetensors").ok


def test_inspect_of_the_current_directory_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "workbench inspect ." failed with "PosixPath('.') has an empty name" (the temporary-path look-up)
    from safetensors.torch import save_file

    import workbench as wb

    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    here, there = wb.inspect_checkpoint("."), wb.inspect_checkpoint(tmp_path)
    assert (here.error, here.num_keys, here.findings) == ("", 1, there.findings) == ("", there.num_keys, ())


def test_a_first_save_that_never_finished_is_not_called_the_previous_checkpoint(tmp_path) -> None:
    # only .ck.incomplete exists: the old hint said "ck itself is the previous complete checkpoint"; there is none
    write(tmp_path / ".ck.incomplete", model())
    ins = inspect_checkpoint(tmp_path / "ck")
    (finding,) = [f for f in ins.findings if f.kind == "incomplete_checkpoint"]
    assert "the first save to ck never finished" in finding.hint and "no complete checkpoint" in finding.hint
    assert "previous complete checkpoint" not in finding.hint and "wb.clean_incomplete" in finding.hint
    write(tmp_path / "ck", model())  # a complete checkpoint beside it: that one is the previous one
    (finding,) = [f for f in inspect_checkpoint(tmp_path / "ck").findings if f.kind == "incomplete_checkpoint"]
    assert "ck itself is the previous complete checkpoint" in finding.hint
    (tmp_path / "ck").rename(tmp_path / ".ck.old")  # a publish stopped between its renames: the aside is the one
    hints = [f.hint for f in inspect_checkpoint(tmp_path / "ck").findings if f.kind == "incomplete_checkpoint"]
    assert any("stopped while publishing" in h for h in hints) and not any("first save" in h for h in hints)
