"""``config_files`` are taken when ``save_hf`` is called, not when an async save publishes at ``wait()``.

A relative name used to be resolved against the working directory of ``wait()``'s moment, and the file copied as it
was then: a ``chdir`` between the call and ``wait()`` put another folder's ``config.json`` into the checkpoint, or
failed the whole save after every byte was written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import workbench as wb


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    for run, text in ((run_a, '{"model": "A"}'), (run_b, '{"model": "B"}')):
        run.mkdir()
        (run / "config.json").write_text(text)
    return run_a, run_b


def test_an_async_save_publishes_the_config_files_as_they_were_at_the_call(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run_a, run_b = _runs(tmp_path)
    os.chmod(run_a / "config.json", 0o640)
    os.utime(run_a / "config.json", (1_600_000_000, 1_600_000_000))
    monkeypatch.chdir(run_a)
    handle = wb.save_hf({"w": torch.ones(4)}, tmp_path / "ckpt", config_files=["config.json"], async_save=True)
    monkeypatch.chdir(run_b)  # the next experiment's folder, which holds a config.json of its own
    (run_a / "config.json").write_text('{"model": "A, edited after the call"}')
    handle.wait()
    published = tmp_path / "ckpt" / "config.json"
    assert published.read_text() == '{"model": "A"}'
    assert published.stat().st_mode & 0o777 == 0o640 and published.stat().st_mtime == 1_600_000_000  # as copy2


def test_an_async_save_publishes_a_config_file_removed_after_the_call(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run_a, _ = _runs(tmp_path)
    monkeypatch.chdir(run_a)
    handle = wb.save_hf({"w": torch.ones(4)}, tmp_path / "ckpt", config_files=["config.json"], async_save=True)
    monkeypatch.chdir(tmp_path)  # no config.json here
    (run_a / "config.json").unlink()
    handle.wait()
    assert (tmp_path / "ckpt" / "config.json").read_text() == '{"model": "A"}'


def test_a_missing_config_file_is_refused_at_the_call_naming_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(wb.SaveFailed, match=f"do not exist: .*{tmp_path / 'tokenizer.json'}"):
        wb.save_hf({"w": torch.ones(4)}, tmp_path / "ckpt", config_files=["tokenizer.json"], async_save=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before anything was made


def test_a_config_path_through_a_linked_folder_and_dotdot_is_the_file_the_os_opens(tmp_path, monkeypatch) -> None:
    # os.path.abspath folds "link/.." as text: weights/../config.json named the cwd's config.json, not the model's
    import json

    real = tmp_path / "data" / "llama"
    (real / "weights").mkdir(parents=True)
    (real / "config.json").write_text(json.dumps({"model": "right"}))
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.json").write_text(json.dumps({"model": "wrong"}))
    (work / "weights").symlink_to(real / "weights")
    monkeypatch.chdir(work)
    wb.save_hf({"w": torch.ones(4)}, tmp_path / "ckpt", config_files=["weights/../config.json"])
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == {"model": "right"}
