"""Tied parameters in loads a reviewer found refused or slow: a checkpoint that stores one key of a tie (what HF
writes for ``tie_word_embeddings=True``) loaded with ``strict=False``, tied keys stored bit-identical holding a NaN,
and the overlap check over thousands of views of one flat buffer (it compared every pair)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from workbench.errors import CheckpointError
from workbench.io.hf.tied import untie


class _Tied(torch.nn.Module):
    """``head.weight = embed.weight``, with the embedding registered first or last."""

    def __init__(self, embed_first: bool) -> None:
        super().__init__()
        if embed_first:
            self.embed = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
        else:
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.embed = torch.nn.Embedding(16, 8)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.ones(8))


@pytest.mark.parametrize("embed_first", [True, False])
@pytest.mark.parametrize("stored", ["embed.weight", "head.weight"])
def test_a_checkpoint_storing_one_key_of_a_tie_fills_the_shared_tensor(
    tmp_path: Path, stored: str, embed_first: bool
) -> None:
    values = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    save_file({stored: values, "norm": torch.full((8,), 3.0)}, str(tmp_path / "model.safetensors"))
    model = _Tied(embed_first)
    with torch.no_grad():
        model.embed.weight.zero_()
    report = wb.load_hf(model, tmp_path, strict=False)
    other = ({"embed.weight", "head.weight"} - {stored}).pop()
    assert report.missing == (other,)
    assert model.head.weight is model.embed.weight  # still one tensor
    assert torch.equal(model.embed.weight.detach(), values)
    assert torch.equal(model.norm.detach(), torch.full((8,), 3.0))


def test_tied_keys_stored_bit_identical_with_a_nan_load(tmp_path: Path) -> None:
    values = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    values[3, 4] = float("nan")
    save_file({"embed.weight": values, "head.weight": values.clone(), "norm": torch.ones(8)},
              str(tmp_path / "model.safetensors"))
    model = _Tied(True)
    wb.load_hf(model, tmp_path)
    assert torch.equal(model.embed.weight.detach().view(torch.int32), values.view(torch.int32))


def test_tied_keys_whose_nans_differ_in_bits_are_still_refused(tmp_path: Path) -> None:
    values = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    values[0, 0] = float("nan")
    other = values.clone()
    other.view(torch.int32)[0, 0] += 1  # another NaN payload: one tensor cannot hold both
    save_file({"embed.weight": values, "head.weight": other, "norm": torch.ones(8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="hold different values"):
        wb.load_hf(_Tied(True), tmp_path)


def test_thousands_of_views_of_one_buffer_are_checked_at_once() -> None:
    # every pair compared took 17 s for 4,000 views (68 s for 8,000); one sort and sweep takes milliseconds
    count = 4000
    flat = torch.zeros(count * 16)
    targets = {f"p{i}": flat[i * 16:(i + 1) * 16].view(4, 4) for i in range(count)}
    began = time.perf_counter()
    out, ties = untie(targets, 0)
    assert time.perf_counter() - began < 2.0
    assert ties == () and all(out[n] is t for n, t in targets.items())


def test_identical_views_are_tied_to_the_first_and_other_views_keep_their_memory() -> None:
    flat = torch.zeros(64)
    targets = {"a": flat[:16].view(4, 4), "x": flat[16:32], "b": flat[:16].view(4, 4), "c": flat[:16].view(4, 4)}
    out, ties = untie(targets, 0)
    assert ties == (("b", "a"), ("c", "a"))
    assert out["a"] is targets["a"] and out["x"] is targets["x"]
    assert out["b"].data_ptr() != flat.data_ptr() and out["c"].data_ptr() not in (flat.data_ptr(), out["b"].data_ptr())


@pytest.mark.parametrize("spanning_first", [True, False])
def test_a_view_overlapping_one_of_thousands_is_refused_naming_both(spanning_first: bool) -> None:
    flat = torch.zeros(3000 * 4)
    pieces = {f"p{i}": flat[i * 4:(i + 1) * 4] for i in range(3000)}
    spanning = {"wide": flat[4 * 1000 + 2:4 * 1002]}  # from the middle of p1000 to the end of p1001
    targets = {**spanning, **pieces} if spanning_first else {**pieces, **spanning}
    names = "'wide' \\(6,\\) and 'p1000'" if spanning_first else "'p1000' \\(4,\\) and 'wide'"
    with pytest.raises(CheckpointError, match=names + ".* overlap in memory without being the same tensor"):
        untie(targets, 0)
