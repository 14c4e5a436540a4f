"""save_hf and load_hf in one process (plain tensors, a mesh of one rank): file names, index and metadata, per-key
save dtypes, config files, async save, replacing a checkpoint, and bit-exact round trips."""

from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Replicate

import workbench as wb
from tests.io.support import bits, nbytes, random_tensor, small_model
from workbench.errors import CheckpointError, LayoutError
from workbench.io.files.index import INDEX_NAME
from workbench.layout.layout_file import LAYOUT_FILE_NAME, read_checkpoint_layout

FILE_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _everything(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read file by file with safetensors itself."""
    out: dict[str, torch.Tensor] = {}
    for file in _shards(path):
        tensors = load_file(file)
        assert not out.keys() & tensors.keys(), file
        out.update(tensors)
    return out


def _mixed_model() -> dict[str, torch.Tensor]:
    """Nine keys of 128 or 64 bytes each (fp32 and bf16), a norm, an int64 counter and a bool mask."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(3):
        out[f"model.layers.{layer}.mlp.weight"] = torch.randn(8, 4, generator=gen)  # 128 B
        out[f"model.layers.{layer}.attn.weight"] = torch.randn(8, 4, generator=gen).to(torch.bfloat16)  # 64 B
        out[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(16, generator=gen).to(torch.bfloat16)
    out["model.step"] = torch.tensor(7, dtype=torch.int64)
    out["model.mask"] = torch.rand(3, 5, generator=gen) > 0.5
    return out


def test_files_index_and_metadata(tmp_path: Path) -> None:
    state = _mixed_model()
    path = tmp_path / "ckpt"
    result = wb.save_hf(state, path, max_shard_bytes=200)

    assert isinstance(result, wb.SaveResult)
    files = _shards(path)
    total = len(files)
    assert total > 2
    assert [f.name for f in files] == [f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(1, total + 1)]
    assert all(FILE_NAME.fullmatch(f.name) for f in files)
    assert result.path == path and result.rank == 0 and result.files == tuple(f.name for f in files)
    assert result.bytes_written == sum(f.stat().st_size for f in files)
    assert sorted(p.name for p in path.iterdir()) == sorted([INDEX_NAME, LAYOUT_FILE_NAME, *(f.name for f in files)])
    carried = read_checkpoint_layout(path)  # the layout it was saved with, for diagnose's provenance
    assert (carried is not None and list(carried.specs) == sorted(state)) or set(carried.specs) == set(state)

    index = _index(path)
    assert index["metadata"]["total_size"] == sum(nbytes(t) for t in state.values())
    assert set(index["weight_map"]) == set(state)
    fingerprint = wb.Layout.from_model(state).fingerprint()
    assert index["metadata"]["workbench_version"] == wb.__version__
    assert index["metadata"]["layout"] == fingerprint
    for file in files:
        with safe_open(file, "pt") as handle:
            keys = list(handle.keys())
            metadata = handle.metadata()
        assert metadata["workbench_version"] == wb.__version__ and metadata["layout"] == fingerprint, file
        assert all(index["weight_map"][k] == file.name for k in keys)
        file_bytes = sum(nbytes(state[k]) for k in keys)
        assert file_bytes <= 200 or len(keys) == 1, (file, keys)  # the cap, unless one key is bigger alone

    # safetensors reads every file back, and they hold exactly the state dict
    read = _everything(path)
    assert read.keys() == state.keys()
    assert all(read[k].dtype == state[k].dtype and torch.equal(read[k], state[k]) for k in state)


def test_a_different_layout_gives_a_different_fingerprint(tmp_path: Path) -> None:
    state = _mixed_model()
    wb.save_hf(state, tmp_path / "a")
    wb.save_hf({**state, "model.step": torch.zeros(2, dtype=torch.int64)}, tmp_path / "b")
    assert _index(tmp_path / "a")["metadata"]["layout"] != _index(tmp_path / "b")["metadata"]["layout"]


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    # random bit patterns: NaNs with payloads, infs, denormals, in every dtype of the helper
    state = {**small_model(), "model.layers.1.w": random_tensor((5, 3), torch.float32, 9)}
    path = tmp_path / "ckpt"
    wb.save_hf(state, path, max_shard_bytes=64)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    report = wb.load_hf(target, path)

    assert isinstance(report, wb.LoadReport)
    assert report.ok and report.parameters == len(state) and report.rank == 0
    assert report.bytes_read == report.bytes_owned == _index(path)["metadata"]["total_size"]
    assert report.read_ratio == 1.0
    for key, tensor in state.items():
        assert target[key].dtype == tensor.dtype and torch.equal(bits(target[key]), bits(tensor)), key


@pytest.mark.parametrize("read_direct", [True, False])
def test_load_hf_reads_around_the_page_cache_when_asked(read_direct: bool) -> None:
    """``read_direct=True`` sends every read through O_DIRECT (on a disk directory: tmpfs refuses it), ``False``
    none; the values are the saved ones, bit for bit, either way."""
    import tempfile

    state = {"a": random_tensor((1024, 300), torch.float32, 3), "b": random_tensor((77, 5), torch.bfloat16, 4)}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        path = Path(root) / "ckpt"
        wb.save_hf(state, path)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        report = wb.load_hf(target, path, read_direct=read_direct)
        total = _index(path)["metadata"]["total_size"]
    for key, tensor in state.items():
        assert torch.equal(bits(target[key]), bits(tensor)), key
    if not read_direct:
        assert report.bytes_direct == 0
    elif report.bytes_direct == 0:
        pytest.skip("/var/tmp refuses O_DIRECT here")
    else:  # the aligned cover of each request: what is owned, plus at most 8 KiB a file
        assert total <= report.bytes_direct <= total + 8192 * 2


def test_round_trip_of_a_module_through_a_key_map(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))

    def key_map(name: str) -> str:
        return f"model.{name}"

    path = tmp_path / "ckpt"
    wb.save_hf(model, path, key_map=key_map)
    assert set(_index(path)["weight_map"]) == {f"model.{n}" for n, _ in model.named_parameters()}

    copy = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    with torch.no_grad():
        for p in copy.parameters():
            p.zero_()
    assert wb.load_hf(copy, path, key_map=key_map).ok
    for (name, want), got in zip(model.state_dict().items(), copy.state_dict().values()):
        assert torch.equal(want, got), name


def test_a_tensor_the_given_layout_does_not_list_is_refused_not_left_out(tmp_path: Path) -> None:
    state = _mixed_model()
    listed = {k: v for k, v in state.items() if k != "model.mask"}
    layout = wb.Layout.from_model(listed)
    with pytest.raises(LayoutError, match=r"1 tensor\(s\) that the layout .* does not list: \['model.mask'\]"):
        wb.save_hf(state, tmp_path / "refused", layout=layout)
    assert not (tmp_path / "refused").exists()
    # left out on purpose: a key map that maps it to None
    wb.save_hf(state, tmp_path / "ckpt", layout=layout, key_map=lambda name: None if name == "model.mask" else name)
    assert set(_everything(tmp_path / "ckpt")) == set(listed)


def test_a_given_layout_that_cuts_a_tensor_otherwise_than_the_model_is_refused_by_name(tmp_path: Path) -> None:
    # rank 0 of a model sharded over 2 ranks holds rows 0:2 of w; a layout of another mesh that replicates w says it
    # holds all 4 rows: the load failed deep in a copy with "RuntimeError: setStorage"
    wb.save_hf({"w": torch.arange(16.0).reshape(4, 4)}, tmp_path / "ckpt")
    other = wb.MeshSpec((2,), ("dp",))
    layout = wb.Layout(other, {"w": wb.LoadSpec.from_placements("w", ["w"], (4, 4), other, [Replicate()])})
    model = {"w": torch.zeros(2, 4)}
    with pytest.raises(LayoutError, match=r"'w': rank 0 holds a local tensor of shape \(2, 4\).* gives this rank "
                                          r"\(4, 4\)"):
        wb.load_hf(model, tmp_path / "ckpt", layout=layout)
    assert torch.equal(model["w"], torch.zeros(2, 4))


def test_allow_unexpected_lets_other_keys_be_but_still_needs_every_key_of_the_layout(tmp_path: Path) -> None:
    state = _mixed_model()
    wb.save_hf(state, tmp_path / "ckpt")
    mine = {k: torch.zeros_like(v) for k, v in state.items() if "layers.0" in k}  # a stage's share of the keys
    report = wb.load_hf(mine, tmp_path / "ckpt", allow_unexpected=True)
    others = sorted(k for k in state if "layers.0" not in k)
    assert report.ok and sorted(report.unexpected) == others and "unexpected (allowed)" in str(report)
    assert all(torch.equal(mine[k], state[k]) for k in mine)
    with pytest.raises(CheckpointError, match="in the checkpoint but not in the layout"):
        wb.load_hf(mine, tmp_path / "ckpt")  # without it, strict refuses them as before
    # a key of its own missing is still an error, naming it (strict=False would have skipped it and gone on)
    mine["model.layers.0.extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint.*model\.layers\.0\.extra\.weight"):
        wb.load_hf(mine, tmp_path / "ckpt", allow_unexpected=True)


def test_a_tied_weight_the_layout_lists_under_one_name_is_saved_once(tmp_path: Path) -> None:
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6, bias=False)})
    model["head"].weight = model["embed"].weight  # as tie_word_embeddings does
    layout = wb.Layout.from_model({"embed.weight": model["embed"].weight})  # HF's checkpoint: one key of the tie
    wb.save_hf(model, tmp_path / "ckpt", layout=layout)
    saved = _everything(tmp_path / "ckpt")
    assert list(saved) == ["embed.weight"] and torch.equal(saved["embed.weight"], model["embed"].weight.detach())
    model["head"].weight = torch.nn.Parameter(model["embed"].weight.detach().clone())  # untied: its own values
    with pytest.raises(LayoutError, match=r"does not list: \['head.weight'\]"):
        wb.save_hf(model, tmp_path / "untied", layout=layout)


@pytest.mark.parametrize("patterns", [r".*layernorm\.weight", [r"nothing\.matches", r".*_layernorm\.weight$"]])
def test_fp32_keys_stay_float32_and_dtype_casts_the_other_floats(tmp_path: Path, patterns: object) -> None:
    state = _mixed_model()
    path = tmp_path / "ckpt"
    wb.save_hf(state, path, fp32_keys_pattern=patterns, dtype=torch.bfloat16)

    read = _everything(path)
    for key, tensor in state.items():
        if "layernorm" in key:
            want = torch.float32  # matched: float32, even where the runtime tensor is bf16
        elif tensor.is_floating_point():
            want = torch.bfloat16
        else:
            want = tensor.dtype  # int64 and bool are never cast
        assert read[key].dtype == want, key
        assert torch.equal(read[key], tensor.to(want)), key
    assert _index(path)["metadata"]["total_size"] == sum(nbytes(t) for t in read.values())
    # the checkpoint's own layout file says what its files hold (it said the runtime dtypes): diagnosing the
    # checkpoint against it finds nothing, and its fingerprint is the one the files carry
    carried = read_checkpoint_layout(path)
    assert {name: carried.dtypes[name] for name in state} == {k: str(t.dtype)[6:] for k, t in read.items()}
    report = wb.diagnose(path, expected=path / LAYOUT_FILE_NAME)
    assert report.ok, report
    assert report.stats["layout_fingerprint"] == "same as the layout", report.stats

    # loading into the runtime dtypes: refused unless asked, naming each key and both dtypes
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CheckpointError, match=r"checkpoint dtype float32, the model's '.*layernorm.*' is bfloat16 "
                       r"\(pass cast=True to convert\)"):
        wb.load_hf(target, path)
    assert not any(t.any() for t in target.values())  # nothing was loaded
    report = wb.load_hf(target, path, strict=False)  # without strict: those keys are skipped and listed
    assert report.mismatched and all("pass cast=True" in m for m in report.mismatched)
    # with cast=True: bf16-exact values for the cast keys, exact for the rest
    assert wb.load_hf(target, path, cast=True).ok
    for key, tensor in state.items():
        assert target[key].dtype == tensor.dtype
        assert torch.equal(target[key], read[key].to(tensor.dtype)), key


def test_config_files_are_copied(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    config = source / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 16}))
    tokenizer = source / "tokenizer_config.json"
    tokenizer.write_text("{}")
    path = tmp_path / "ckpt"
    wb.save_hf(_mixed_model(), path, config_files=[config, str(tokenizer)])
    assert (path / "config.json").read_bytes() == config.read_bytes()
    assert (path / "tokenizer_config.json").read_bytes() == tokenizer.read_bytes()
    assert config.is_file() and tokenizer.is_file()  # copied, not moved


def test_async_save_publishes_on_wait(tmp_path: Path) -> None:
    state = _mixed_model()
    path = tmp_path / "ckpt"
    handle = wb.save_hf(state, path, async_save=True, max_shard_bytes=200)

    assert isinstance(handle, wb.AsyncSave)
    assert not path.exists()  # nothing published before wait(), however far the writes got
    result = handle.wait()
    assert isinstance(result, wb.SaveResult) and handle.done()
    assert handle.wait() is result  # a second wait is harmless
    assert result.files == tuple(f.name for f in _shards(path))
    assert (path / INDEX_NAME).is_file()
    read = _everything(path)
    assert all(torch.equal(read[k], state[k]) for k in state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no hidden temporary left


def test_saving_over_a_checkpoint_replaces_it_atomically(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    old_state = {f"old.{i}": torch.full((4,), float(i)) for i in range(5)}
    wb.save_hf(old_state, path, max_shard_bytes=16)
    (path / "stale.txt").write_text("from an older run")
    old_files = sorted(p.name for p in path.iterdir())
    old_inode = path.stat().st_ino

    new_state = _mixed_model()
    handle = wb.save_hf(new_state, path, async_save=True)
    # until wait(), readers still see the old checkpoint, complete
    assert sorted(p.name for p in path.iterdir()) == old_files
    assert set(_index(path)["weight_map"]) == set(old_state)
    handle.wait()

    # then the new one: a new directory swapped in, not files written over the old ones; the old weights (five
    # shards) are gone, and a file that is not a checkpoint's own is kept beside the new weights
    assert path.stat().st_ino != old_inode
    want = [INDEX_NAME, LAYOUT_FILE_NAME, "model-00001-of-00001.safetensors", "stale.txt"]
    assert sorted(p.name for p in path.iterdir()) == sorted(want)
    assert (path / "stale.txt").read_text() == "from an older run"
    assert set(_index(path)["weight_map"]) == set(new_state)
    read = _everything(path)
    assert read.keys() == new_state.keys() and all(torch.equal(read[k], new_state[k]) for k in new_state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .ckpt.incomplete or .ckpt.old left


def test_a_new_save_first_finishes_the_pending_async_one(tmp_path: Path) -> None:
    # both saves share the hidden temporary .ckpt.incomplete: the second must not start while the first is pending,
    # so save_hf publishes the first one before it begins (as DCP's async save does)
    path = tmp_path / "ckpt"
    first_state, second_state = {"a": torch.ones(4)}, {"b": torch.zeros(4)}
    first = wb.save_hf(first_state, path, async_save=True)
    other = wb.save_hf({"c": torch.full((2,), 3.0)}, tmp_path / "other", async_save=True)
    assert not (tmp_path / "other").exists()  # not published until waited on
    second = wb.save_hf(second_state, tmp_path / "." / "ckpt", async_save=True)  # the same path, spelled differently
    assert first.wait().path == path and other.wait().path == tmp_path / "other"  # done by the second call
    assert _everything(tmp_path / "other")["c"].tolist() == [3.0, 3.0]
    second.wait()
    read = _everything(path)
    assert read.keys() == second_state.keys() and torch.equal(read["b"], second_state["b"])


def test_an_async_save_is_a_snapshot_of_the_call_time_values(tmp_path: Path) -> None:
    # tensors that need no gather (every one here: one process) are the model's own storage: the save must copy them
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "n": torch.arange(3)}
    expected = {k: v.clone() for k, v in state.items()}
    handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True, write_threads=1)
    for tensor in state.values():
        tensor.add_(41)  # the optimizer step, right after save_hf returned
    result = handle.wait()
    read = _everything(tmp_path / "ckpt")
    assert all(torch.equal(read[k], expected[k]) for k in expected), "the file holds values from after the call"
    assert result.snapshot_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_a_failed_background_write_surfaces_at_wait_and_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    from workbench.faults import FAULT_ENV

    wb.save_hf({"old": torch.zeros(2)}, tmp_path / "ckpt")
    monkeypatch.setenv(FAULT_ENV, "write@0:enospc")
    handle = wb.save_hf({"new": torch.ones(2)}, tmp_path / "ckpt", async_save=True)
    with pytest.raises(wb.SaveFailed, match=r"rank 0 failed while writing 'new'.*No space left"):
        handle.wait()
    with pytest.raises(wb.SaveFailed, match="No space left"):
        handle.result()  # the same error again, not a second attempt
    assert list(_everything(tmp_path / "ckpt")) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_failed_async_save_not_waited_on_surfaces_at_the_next_save(tmp_path: Path, monkeypatch) -> None:
    from workbench.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "write@0:efbig")
    handle = wb.save_hf({"new": torch.ones(2)}, tmp_path / "a", async_save=True)
    while not handle.done():  # the background write fails while the fault is set
        time.sleep(0.01)
    monkeypatch.delenv(FAULT_ENV)
    with pytest.raises(wb.SaveFailed, match=r"(?s)earlier async save failed.*File too large"):
        wb.save_hf({"x": torch.ones(2)}, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    wb.save_hf({"x": torch.ones(2)}, tmp_path / "b")  # reported once; the next save works
    assert (tmp_path / "b" / INDEX_NAME).is_file()


def test_a_warmed_pool_serves_the_first_async_save_without_allocating(tmp_path: Path, monkeypatch) -> None:
    from workbench.io.files import host_pool as pools

    monkeypatch.setattr(pools, "_POOLS", {})  # a fresh process's pools
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256 * (i + 1), 1024, generator=gen) for i in range(4)}  # 1, 2, 3 and 4 MiB
    assert wb.warm_host_pool(state) == (1 + 2 + 4 + 4) << 20  # one buffer per tensor, power-of-two classes
    assert wb.warm_host_pool(state) == 0  # already there
    pool = pools.host_pool(pinned=False)
    allocated = pool.allocations
    handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True)
    for t in state.values():
        t.add_(1)  # the snapshot was taken into the reserved buffers
    result = handle.wait()
    assert result.snapshot_bytes == sum(nbytes(t) for t in state.values())
    assert pool.allocations == allocated
    read = _everything(tmp_path / "ckpt")
    assert all(torch.equal(read[k] + 1, state[k]) for k in state)


def test_a_pool_buffer_serves_a_smaller_piece_up_to_four_times_smaller() -> None:
    from workbench.io.files.host_pool import HostPool

    pool = HostPool(64 << 20)
    pool.reserve([8 << 20])
    small = pool.acquire((1 << 20,), torch.uint8)  # 1 MiB: 8x smaller, a buffer of its own
    quarter = pool.acquire((2 << 20,), torch.uint8)  # 2 MiB: the reserved 8 MiB buffer
    assert pool.allocations == 2 and pool.bytes_out == (1 + 8) << 20
    small.release()
    quarter.release()
    assert pool.bytes_out == 0 and pool.bytes_held == (1 + 8) << 20


def test_a_fused_tensor_given_as_a_view_is_saved_by_its_values(tmp_path: Path) -> None:
    """A state dict may hold views (a transposed weight): the direct writer of a whole tensor reads its values in
    row-major order, not its storage."""
    base = torch.arange(6 * 8, dtype=torch.float32).reshape(8, 6)
    state = {"w": base.t()}  # (6, 8), not contiguous
    layout = wb.Layout(wb.MeshSpec((1,), ("world",)),
                       {"w": wb.LoadSpec.from_placements("w", ["a", "b", "c"], (6, 8), wb.MeshSpec((1,), ("world",)),
                                                         [Replicate()], fused_dim=0)})
    wb.save_hf(state, tmp_path / "ckpt", layout=layout, write_mode="direct")
    read = _everything(tmp_path / "ckpt")
    assert all(torch.equal(read[k], base.t()[2 * i : 2 * i + 2]) for i, k in enumerate("abc"))


def test_an_async_save_to_a_relative_path_lands_there_after_a_chdir(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # its writers, heartbeat and publish run after the call: they used the relative path against the working
    # directory of that moment, and wait() failed with the half-written temporary left behind
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    handle = wb.save_hf(state, "ckpt", async_save=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = handle.wait()
    assert result.path == tmp_path / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "elsewhere"]  # nothing left half-written
    assert list((tmp_path / "elsewhere").iterdir()) == []
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    wb.load_hf(loaded, tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("async_save", [False, True])
def test_saving_into_a_model_folder_replaces_its_weights_and_keeps_its_other_files(tmp_path: Path,
                                                                                   async_save: bool) -> None:
    # an HF model folder (or a trainer's checkpoint-N): config, tokenizer and optimizer state beside the weights.
    # The save used to replace the folder whole and delete them; the old weights must still go (a stale shard
    # beside a new index is a broken checkpoint)
    path = tmp_path / "model"
    wb.save_hf({f"old.{i}": torch.full((4,), float(i)) for i in range(3)}, path, max_shard_bytes=16)
    others = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"version": "1.0"}',
              "optimizer.pt": bytes(range(256)) * 4, "training_args.bin": b"args", "rng_state_0.pth": b"rng"}
    for name, data in others.items():
        (path / name).write_bytes(data)
    # weights of another save, in any format, and their indexes: never kept beside the new weights
    for name in ("model.safetensors", "pytorch_model.bin", "pytorch_model-00001-of-00002.bin",
                 "pytorch_model.bin.index.json", "consolidated.00.pth"):
        (path / name).write_bytes(b"old weights")
    new_state = _mixed_model()
    handle = wb.save_hf(new_state, path, async_save=async_save)
    if async_save:
        handle.wait()
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([INDEX_NAME, LAYOUT_FILE_NAME, "model-00001-of-00001.safetensors", *others]), names
    assert all((path / name).read_bytes() == data for name, data in others.items())
    read = _everything(path)
    assert read.keys() == new_state.keys() and all(torch.equal(read[k], new_state[k]) for k in new_state)


def test_a_file_removed_while_it_is_carried_over_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # its owner deletes a temporary file of its own between the carry's scan and its link: the save goes on
    from workbench.io.files import publish

    path = tmp_path / "model"
    wb.save_hf({"w": torch.ones(4)}, path)
    (path / "config.json").write_text("{}")
    (path / "optimizer.pt.tmp").write_text("going")
    real = os.link

    def link(src: str, dst: object, **kwargs: object) -> None:
        if str(src).endswith("optimizer.pt.tmp"):
            os.unlink(src)
        real(src, dst, **kwargs)

    monkeypatch.setattr(publish.os, "link", link)
    wb.save_hf({"w": torch.full((4,), 2.0)}, path)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [INDEX_NAME, LAYOUT_FILE_NAME, "model-00001-of-00001.safetensors", "config.json"])


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_files_written_into_the_model_folder_while_a_save_publishes_are_kept(tmp_path: Path, exchange: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # another process writes a tokenizer and replaces config.json (atomically) after the carry looked at the folder,
    # before the new checkpoint is swapped in: both used to go with the old checkpoint
    from workbench.io.files import publish

    path = tmp_path / "model"
    wb.save_hf({"w": torch.ones(4)}, path)
    (path / "config.json").write_text('{"old": true}')
    real = publish.AtomicRenamePublisher._carry_other_files

    def carry_then_write(temporary: Path, final: Path) -> dict:
        carried = real(temporary, final)
        (final / "tokenizer.json").write_text('{"written": "meanwhile"}')
        (final / "config.json.tmp").write_text('{"new": true}')
        os.replace(final / "config.json.tmp", final / "config.json")
        return carried

    monkeypatch.setattr(publish.AtomicRenamePublisher, "_carry_other_files", staticmethod(carry_then_write))
    if not exchange:
        monkeypatch.setattr(publish, "exchange_paths", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    wb.save_hf({"w": torch.full((4,), 2.0)}, path)
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([INDEX_NAME, LAYOUT_FILE_NAME, "model-00001-of-00001.safetensors", "config.json",
                            "tokenizer.json"]), names
    assert (path / "config.json").read_text() == '{"new": true}'
    assert (path / "tokenizer.json").read_text() == '{"written": "meanwhile"}'
    assert torch.equal(_everything(path)["w"], torch.full((4,), 2.0))


def test_a_model_folder_of_a_config_before_any_weights_takes_a_save(tmp_path: Path) -> None:
    # save_pretrained of the config and tokenizer first, the weights after: the folder holds no weight yet
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    wb.save_hf({"w": torch.ones(4)}, path)
    assert (path / "config.json").read_text() == "{}" and (path / "tokenizer.json").is_file()
    assert torch.equal(_everything(path)["w"], torch.ones(4))


def test_a_late_file_that_cannot_be_moved_is_a_warning_and_keeps_the_replaced_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the publish is done when the late files are moved: a failure there used to raise "nothing was published"
    # over a published checkpoint (with the save's marker left in it) and delete the user's late file
    from workbench.io.files import publish
    from workbench.io.files.ownership import MARKER_NAME

    path = tmp_path / "model"
    wb.save_hf({"w": torch.ones(4)}, path)
    (path / "config.json").write_text("{}")
    old = publish.temporary_path(path)
    real_exchange, real_replace = publish.exchange_paths, os.replace

    def exchange_then_write(a: Path, b: Path) -> bool:
        done = real_exchange(a, b)
        (Path(a) / "tokenizer.json").write_text("late")  # a writer that resolved the folder before the swap
        return done

    def refuse(src: object, dst: object) -> None:
        if str(src).endswith("tokenizer.json"):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        real_replace(src, dst)

    monkeypatch.setattr(publish, "exchange_paths", exchange_then_write)
    monkeypatch.setattr(publish.os, "replace", refuse)
    with pytest.warns(UserWarning, match=r"tokenizer\.json .*move them out now"):
        wb.save_hf({"w": torch.full((4,), 2.0)}, path)
    assert torch.equal(_everything(path)["w"], torch.full((4,), 2.0))
    assert not (path / MARKER_NAME).exists() and (path / "config.json").read_text() == "{}"
    assert (old / "tokenizer.json").read_text() == "late"


def test_a_model_folder_of_weights_in_another_format_is_refused_and_left_alone(tmp_path: Path) -> None:
    # config.json beside pytorch_model.bin: a save of safetensors would delete the only weights it holds
    path = tmp_path / "bert"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "pytorch_model.bin").write_bytes(b"weights")
    with pytest.raises(wb.SaveFailed, match=r"weights are in another format \(pytorch_model\.bin\)"):
        wb.save_hf({"w": torch.ones(4)}, path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "pytorch_model.bin"]


@pytest.mark.parametrize("beside", [[], ["model.safetensors"]], ids=["adapter-folder", "beside-a-model"])
def test_a_peft_adapter_is_never_taken_for_a_checkpoint(tmp_path: Path, beside: list[str]) -> None:
    # adapter_config.json + adapter_model.safetensors: a save used to count any .safetensors file as a checkpoint's,
    # replace the folder and delete the adapter's weights
    path = tmp_path / "lora"
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    for name in ("adapter_model.safetensors", *beside):
        save_file({"w": torch.ones(2)}, str(path / name))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(wb.SaveFailed, match=r"safetensors files that are not a checkpoint's model weights "
                       r"\(adapter_model\.safetensors: a PEFT adapter's"):
        wb.save_hf({"w": torch.full((4,), 3.0)}, path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]  # no .lora.incomplete left beside it


def test_a_single_file_checkpoint_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "one"
    path.mkdir()
    save_file({"old": torch.ones(2)}, str(path / "model.safetensors"))  # HF's one-file checkpoint, no index
    (path / "config.json").write_text("{}")
    wb.save_hf({"w": torch.full((4,), 3.0)}, path)
    assert sorted(p.name for p in path.iterdir()) == sorted(["config.json", INDEX_NAME, LAYOUT_FILE_NAME,
                                                             "model-00001-of-00001.safetensors"])
    assert torch.equal(_everything(path)["w"], torch.full((4,), 3.0))


def test_a_checkpoint_with_its_weights_in_another_layout_beside_them_is_replaced(tmp_path: Path) -> None:
    # Mistral's folders hold consolidated.safetensors beside the HF shards: the same weights, replaced with them
    path = tmp_path / "mistral"
    path.mkdir()
    save_file({"old": torch.ones(2)}, str(path / "model.safetensors"))
    save_file({"old": torch.ones(2)}, str(path / "consolidated.safetensors"))
    (path / "params.json").write_text("{}")
    wb.save_hf({"w": torch.full((4,), 3.0)}, path)
    assert sorted(p.name for p in path.iterdir()) == sorted([INDEX_NAME, LAYOUT_FILE_NAME, "params.json",
                                                             "model-00001-of-00001.safetensors"])
    assert torch.equal(_everything(path)["w"], torch.full((4,), 3.0))


def test_a_folder_of_another_models_safetensors_is_refused_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "unet"
    path.mkdir()
    save_file({"w": torch.ones(2)}, str(path / "diffusion_pytorch_model.safetensors"))
    (path / "config.json").write_text("{}")
    with pytest.raises(wb.SaveFailed, match=r"\(diffusion_pytorch_model\.safetensors: a PEFT adapter's, another "
                       r"model's or another variant's\), which a save would delete"):
        wb.save_hf({"w": torch.full((4,), 3.0)}, path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
