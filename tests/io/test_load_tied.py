"""Loads into tensors whose memory is not theirs alone (a reviewer's repros): tied parameters (one tensor, two keys)
and views a file's bytes cannot be read into as they are (conjugate, negative, expanded). Each used to return
normally with wrong values in the model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench.errors import CheckpointError


def _tied() -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.head = torch.nn.Linear(4, 8, bias=False)
    model.head.weight = model.embed.weight  # tie_word_embeddings
    return model


def test_a_tied_model_saved_and_loaded_round_trips(tmp_path: Path) -> None:
    source = _tied()
    wb.save_hf(source, tmp_path / "ckpt")
    saved = {}
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        saved.update(load_file(f))
    assert torch.equal(saved["embed.weight"], saved["head.weight"])  # a save writes both keys, equal
    target = _tied()
    report = wb.load_hf(target, tmp_path / "ckpt")
    assert report.parameters == 2
    assert target.head.weight is target.embed.weight  # still tied
    assert torch.equal(target.embed.weight.detach(), source.embed.weight.detach())


def test_tied_parameters_whose_keys_differ_are_refused_naming_both(tmp_path: Path) -> None:
    torch.manual_seed(0)
    keys = {"embed.weight": torch.randn(8, 4), "head.weight": torch.randn(8, 4)}
    save_file(keys, str(tmp_path / "model.safetensors"))
    target = _tied()
    with pytest.raises(CheckpointError, match=r"parameters 'embed.weight' and 'head.weight' share one tensor"):
        wb.load_hf(target, tmp_path)


def test_views_that_overlap_without_being_the_same_are_refused_before_reading(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_file({"a": torch.randn(2, 3), "b": torch.randn(2, 3)}, str(tmp_path / "model.safetensors"))
    buffer = torch.zeros(10)
    state = {"a": buffer[0:6].view(2, 3), "b": buffer[4:10].view(2, 3)}
    with pytest.raises(CheckpointError, match=r"'a' \(2, 3\) and 'b' \(2, 3\) overlap in memory"):
        wb.load_hf(state, tmp_path)
    assert torch.equal(buffer, torch.zeros(10))  # nothing was read into it


def test_conjugate_and_negative_views_get_the_files_values_and_an_expanded_one_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    values = {"c": torch.randn(3, dtype=torch.complex64), "n": torch.randn(4), "e": torch.randn(2, 3)}
    save_file(values, str(tmp_path / "model.safetensors"))
    base_c, base_n = torch.zeros(3, dtype=torch.complex64), torch.zeros(4, dtype=torch.complex64)
    state = {"c": base_c.conj(), "n": base_n.conj().imag}  # the imaginary part of a conjugate: a negative view
    assert state["c"].is_conj() and state["n"].is_neg()
    wb.load_hf(state, tmp_path, strict=False)
    assert torch.equal(state["c"].resolve_conj(), values["c"]) and torch.equal(state["n"].resolve_neg(), values["n"])
    expanded = {"e": torch.zeros(1, 3).expand(2, 3)}  # two rows, one memory
    with pytest.raises(CheckpointError):
        wb.load_hf(expanded, tmp_path, strict=False)


def _tied_on_rank_1_only(path: str) -> str:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    import workbench as wb

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("dp",))
    layout = wb.Layout(mesh, {n: wb.LoadSpec.from_placements(n, n, (8, 4), mesh, [Replicate()])
                              for n in ("embed.weight", "head.weight")})
    one = torch.zeros(8, 4)
    state = {"embed.weight": one, "head.weight": one if rank == 1 else torch.zeros(8, 4)}  # rank 1 ties them
    start = time.perf_counter()
    try:
        wb.load_hf(state, path, layout=layout)
    except CheckpointError as exc:
        return f"{type(exc).__name__} after {time.perf_counter() - start:.1f}s: {exc}"
    return "loaded"


@pytest.mark.slow
def test_a_tie_that_fails_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    # the check runs after the reads, before the last agreement: its peer learns of it there, naming the rank
    torch.manual_seed(0)
    keys = {"embed.weight": torch.randn(8, 4), "head.weight": torch.randn(8, 4)}
    save_file(keys, str(tmp_path / "model.safetensors"))
    results = wb.launch(_tied_on_rank_1_only, nprocs=2, args=(str(tmp_path),), timeout=60)
    for rank, text in results.items():
        assert text.startswith("LoadFailed after") or text.startswith("CheckpointError after"), (rank, text)
        assert float(text.split(" after ")[1].split("s:")[0]) < 10, text
        assert "rank 1 failed while checking its tied parameters" in text, text
        assert "'embed.weight' and 'head.weight' share one tensor" in text, text
