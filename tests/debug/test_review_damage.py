"""Damaged checkpoints found by review: each case used to hang, claim something wrong, or advise losing data."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from workbench.debug import diagnose, inspect_checkpoint
from workbench.io.files.index import INDEX_NAME


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"model.embed_tokens.weight": torch.randn(10, 4, generator=g).bfloat16(),
            "model.layers.0.mlp.down_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
            "model.layers.0.mlp.up_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
            "model.norm.weight": torch.randn(4, generator=g)}


def _sharded(directory: Path) -> Path:
    """Two shards (two keys each) and their index, written by safetensors itself."""
    tensors = _tensors()
    directory.mkdir(parents=True)
    weight_map = {}
    for i, keys in enumerate((list(tensors)[:2], list(tensors)[2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in keys}, str(directory / name))
        weight_map |= dict.fromkeys(keys, name)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _within(seconds: float, call):
    """``call()``'s result, or an AssertionError when it has not returned within ``seconds`` (a hang)."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"no answer within {seconds} s: it hangs"
    return result[0]


def test_a_fifo_where_a_shard_should_be_does_not_hang(tmp_path) -> None:
    ref = _sharded(tmp_path / "ref")
    bad = _sharded(tmp_path / "bad")
    shard = bad / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)  # opening a FIFO for reading blocks until a writer comes: none ever does
    report = _within(30, lambda: diagnose(bad, str(ref)))
    assert report.exit_status == 1
    assert {f.key for f in report.findings} >= {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}


def test_shards_of_an_index_that_names_no_file_are_not_called_leftovers_to_delete(tmp_path) -> None:
    ref = _sharded(tmp_path / "ref")
    for name, body in (("not_json", "{not json"), ("empty_map", json.dumps({"metadata": {}, "weight_map": {}}))):
        bad = _sharded(tmp_path / name)
        (bad / INDEX_NAME).write_text(body)  # the shards are intact: they are the data, the index is what broke
        for report in (diagnose(bad, str(ref)), inspect_checkpoint(bad)):
            about_shards = [f for f in report.findings if f.key.endswith(".safetensors")]
            assert len(about_shards) == 2, report.to_text()
            for finding in about_shards:
                assert "delete it" not in finding.hint and "keep it" in finding.hint, finding.hint


def test_a_hugging_face_cache_snapshot_is_read_through_its_links_and_other_links_out_are_named(tmp_path) -> None:
    # a Hugging Face cache snapshot (what snapshot_download returns): every file is a link to ../../blobs/HASH
    ref = _sharded(tmp_path / "ref")
    sharded = _sharded(tmp_path / "snapshots" / "abc")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shard = sharded / "model-00002-of-00002.safetensors"
    shard.rename(blobs / "f00d")
    shard.symlink_to(Path("..", "..", "blobs", "f00d"))
    single = tmp_path / "snapshots" / "one"
    single.mkdir()
    save_file(_tensors(), str(blobs / "beef"))
    (single / "model.safetensors").symlink_to(Path("..", "..", "blobs", "beef"))
    for path in (sharded, single):
        for report in (diagnose(path, str(ref)), inspect_checkpoint(path)):
            assert not report.findings, report.to_text()  # read through the links: values compared, all equal
    # a link out of any other folder, or out of a snapshot but not into its blobs, is named and not opened
    elsewhere = _sharded(tmp_path / "elsewhere")
    stray = _sharded(tmp_path / "snapshots" / "stray")
    for folder in (elsewhere, stray):
        link = folder / "model-00002-of-00002.safetensors"
        link.rename(tmp_path / f"loose-{folder.name}")
        link.symlink_to(tmp_path / f"loose-{folder.name}")
        for report in (diagnose(folder, str(ref)), inspect_checkpoint(folder)):
            linked = [f for f in report.findings if f.key == link.name]
            assert len(linked) == 1, report.to_text()
            finding = linked[0]
            assert "crafted" not in finding.hint and "different saves" not in finding.hint, finding.hint
            assert "symbolic link" in finding.evidence["detail"] and "cp -rL" in finding.hint, finding


def _rewrite_header(path: Path, edit) -> None:
    """Parse the safetensors header of ``path``, ``edit`` it, and write it back (the data bytes kept)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def test_a_key_whose_header_entry_is_damaged_is_not_called_missing(tmp_path) -> None:
    ref = _sharded(tmp_path / "ref")
    (tmp_path / "one").mkdir()
    save_file(_tensors(), str(tmp_path / "one" / "model.safetensors"))
    damages = {"unknown dtype": lambda h: h["model.norm.weight"].update(dtype="F33"),
               "shape against bytes": lambda h: h["model.norm.weight"].update(shape=[3]),
               "entry not an object": lambda h: h.update({"model.norm.weight": 5})}
    for name, edit in damages.items():
        bad = tmp_path / name.replace(" ", "_")
        bad.mkdir()
        save_file(_tensors(), str(bad / "model.safetensors"))
        _rewrite_header(bad / "model.safetensors", edit)  # the key is in the header; its entry is what broke
        report = diagnose(bad, str(ref))
        about = [f for f in report.findings if f.key == "model.norm.weight"]
        assert [f.kind for f in about] == ["corrupt_header"], (name, report.to_text())
        assert "lacks this key" not in about[0].hint


def test_a_folder_that_may_not_be_searched_is_an_error_not_an_exception(tmp_path, monkeypatch) -> None:
    # `chmod a-x` on the folder: every stat of a file in it fails with EACCES (simulated: the tests may run as root)
    ref = _sharded(tmp_path / "ref")
    locked = _sharded(tmp_path / "locked")
    real_stat, real_lstat = os.stat, os.lstat

    def denied(real):
        def stat(path, *args, **kwargs):
            if str(path).startswith(f"{locked}{os.sep}"):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)
        return stat

    monkeypatch.setattr(os, "stat", denied(real_stat))
    monkeypatch.setattr(os, "lstat", denied(real_lstat))
    for report in (diagnose(locked, str(ref)), inspect_checkpoint(locked)):
        assert report.exit_status == 2 and "Permission denied" in report.to_text(), report.to_text()


def test_keys_of_a_file_whose_header_cannot_be_read_are_not_said_to_be_dropped(tmp_path) -> None:
    # the keys are there on disk, in a file whose header (or whose index) broke: "re-save with it" misleads
    from workbench.layout.layout_file import load_layout

    toy = load_layout(Path(__file__).resolve().parents[2] / "sample_meshes" / "toy_expert_tp.toml")
    ref = _sharded(tmp_path / "ref")
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "model.safetensors").write_bytes(b"")
    no_map = _sharded(tmp_path / "no_map")
    (no_map / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    for bad, files in ((zero, ["model.safetensors"]), (no_map, ["model-00001-of-00002.safetensors"])):
        for report in (diagnose(bad, str(ref)), diagnose(bad, toy)):
            missing = [f for f in report.findings if f.kind == "missing_key"]
            assert missing, report.to_text()
            for finding in missing:
                assert "lacks this key" not in finding.hint and "does not: re-save" not in finding.hint, finding.hint
                assert all(f in finding.hint for f in files), finding.hint


def test_an_unpublished_save_with_no_published_checkpoint_beside_it_is_not_to_delete(tmp_path) -> None:
    ref = _sharded(tmp_path / "ref")
    only = _sharded(tmp_path / ".ck.incomplete")  # the save of tmp_path/ck stopped before publish: no ck exists
    finding = next(f for f in diagnose(only, str(ref)).findings if f.kind == "incomplete_checkpoint")
    assert "delete" not in finding.hint and "published checkpoint beside it" not in finding.hint, finding.hint
    assert "no published checkpoint" in finding.hint, finding.hint
    published = _sharded(tmp_path / "ck")
    assert published.is_dir()
    finding = next(f for f in diagnose(only, str(ref)).findings if f.kind == "incomplete_checkpoint")
    assert "load the published checkpoint beside it" in finding.hint  # with ck there, the leftover may go


def test_a_shard_the_index_does_not_name_but_that_holds_its_lost_keys_is_not_to_delete(tmp_path) -> None:
    # the weight_map sends every key to shard 1; shard 2's keys are listed, but under the wrong file
    ref = _sharded(tmp_path / "ref")
    bad = _sharded(tmp_path / "bad")
    body = json.loads((bad / INDEX_NAME).read_text())
    body["weight_map"] = dict.fromkeys(body["weight_map"], "model-00001-of-00002.safetensors")
    (bad / INDEX_NAME).write_text(json.dumps(body))
    for report in (diagnose(bad, str(ref)), inspect_checkpoint(bad)):
        shard = [f for f in report.findings if f.key == "model-00002-of-00002.safetensors"]
        assert len(shard) == 1, report.to_text()
        assert "delete it" not in shard[0].hint and "keep it" in shard[0].hint, shard[0].hint


def test_the_cli_prints_no_terminal_control_sequence_a_key_name_carries(tmp_path, capsys) -> None:
    from workbench.cli import main as workbench_main

    ref = _sharded(tmp_path / "ref")
    tensors = _tensors()
    tensors["model.norm.weight\x1b[2J\x1b]0;pwned\x07"] = tensors.pop("model.norm.weight")  # clear screen, set title
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    for argv in (["inspect", str(bad)], ["diagnose", str(bad), "--expected", str(ref)]):
        workbench_main(argv)
        out = capsys.readouterr()
        assert "model.norm.weight" in out.out, out
        assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err, out
        assert "\\x1b[2J" in out.out  # the key shown escaped, so it can still be found


def test_one_shard_that_cannot_be_read_is_a_finding_and_the_rest_is_compared(tmp_path, monkeypatch) -> None:
    # chmod 000 on one shard (simulated: the tests may run as root): its keys are findings, the other shard is compared
    import builtins

    import workbench.io.files.index as index_module

    ref = _sharded(tmp_path / "ref")
    bad = _sharded(tmp_path / "bad")
    locked = bad / "model-00002-of-00002.safetensors"

    def denied(path, *args, **kwargs):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(index_module, "open", denied, raising=False)
    report = diagnose(bad, str(ref))
    assert report.readable and report.exit_status == 1, report.to_text()
    assert report.stats["equal"] == 2  # the two keys of the readable shard
    about = {f.key: f for f in report.findings}
    for key in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
        assert "Permission denied" in about[key].evidence["detail"] and "does not parse" not in about[key].hint


def test_one_file_of_an_indexed_checkpoint_points_at_its_folder_for_the_keys_its_siblings_hold(tmp_path) -> None:
    # diagnosing model-00001-of-00002.safetensors alone said every key of its sibling was missing: "re-save with it"
    tensors = _tensors()
    names = sorted(tensors)
    folder = tmp_path / "ck"
    folder.mkdir()
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({k: tensors[k] for k in first}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in second[1:]}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second[1:]}}  # second[0] saved nowhere
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file(tensors, str(ref / "model.safetensors"))
    report = diagnose(folder / "model-00001-of-00002.safetensors", str(ref))
    missing = {f.key: f for f in report.findings if f.kind == "missing_key"}
    assert set(missing) == set(second), report.to_text()
    for key in second[1:]:
        assert missing[key].evidence["in_file"] == "model-00002-of-00002.safetensors"
        assert f"diagnose the folder {folder}" in missing[key].hint and "re-save" not in missing[key].hint
    assert "in_file" not in missing[second[0]].evidence and "Re-save" in missing[second[0]].hint  # truly missing
