"""write_safetensors and CheckpointReader: bit-exact round trips, sliced reads, bytes read, compatibility."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from tests.io.support import bits, nbytes, random_tensor, save_checkpoint, small_model
from workbench.errors import CheckpointError
from workbench.io.files.index import read_checkpoint, read_header, safetensors_dtype
from workbench.io.files.read import CheckpointReader
from workbench.io.files.write import write_safetensors

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (7, 5),  # 2-D, odd sizes
        (3, 4, 2),  # 3-D
        (11,),  # 1-D
        (),  # a scalar
        (0, 4),  # empty
    ],
)
def test_round_trip_bit_exact(tmp_path, dtype, shape) -> None:
    tensor = random_tensor(shape, dtype, seed=len(shape))
    path = tmp_path / "one.safetensors"
    size = write_safetensors(path, {"w": tensor})
    assert size == path.stat().st_size
    with CheckpointReader(path) as reader:
        assert reader.keys() == ("w",)
        assert reader.shape("w") == shape
        assert reader.dtype("w") == dtype
        back = reader.read("w")
        assert back.dtype == dtype and tuple(back.shape) == shape
        assert torch.equal(bits(back), bits(tensor)), f"dtype={dtype} shape={shape}"
        assert reader.bytes_read == nbytes(tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize(
    "index",
    [
        (slice(2, 5),),  # rows on dim 0, dim 1 whole
        (slice(2, 5), slice(None)),  # same, explicit
        (slice(None), slice(1, 4)),  # columns on dim 1
        (slice(3, 7), slice(2, 6)),  # a box
        (slice(0, 10), slice(0, 6)),  # everything, as bounds
        (slice(4, 4), slice(None)),  # empty rows
        (slice(9, 10), slice(5, 6)),  # the last element
        (),  # no slices: the whole key
    ],
)
def test_slices_read_only_the_box(tmp_path, dtype, index) -> None:
    tensor = random_tensor((10, 6), dtype, seed=7)
    save_checkpoint(tmp_path / "ckpt", {"w": tensor, "other": random_tensor((100,), torch.float32)})
    expected = tensor[index]
    with CheckpointReader(tmp_path / "ckpt") as reader:
        got = reader.read("w", index)
        assert tuple(got.shape) == tuple(expected.shape), f"index={index}"
        assert torch.equal(bits(got), bits(expected)), f"dtype={dtype} index={index}"
        assert reader.bytes_read == nbytes(expected)
        reader.read("w", index)
        assert reader.bytes_read == 2 * nbytes(expected) and reader.reads == 2


def test_slice_of_a_middle_dim(tmp_path) -> None:
    tensor = random_tensor((4, 6, 5), torch.bfloat16, seed=3)
    write_safetensors(tmp_path / "x.safetensors", {"w": tensor})
    with CheckpointReader(tmp_path / "x.safetensors") as reader:
        got = reader.read("w", (slice(1, 3), slice(2, 5), slice(None)))
        assert torch.equal(bits(got), bits(tensor[1:3, 2:5]))
        assert reader.bytes_read == 2 * 3 * 5 * 2


def test_many_keys_many_files(tmp_path) -> None:
    tensors = small_model()
    plan = save_checkpoint(tmp_path / "ckpt", tensors, {k: i % 3 for i, k in enumerate(tensors)}, max_shard_bytes=64)
    assert len(plan.files) > 3
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert set(reader.keys()) == set(tensors)
        for key, tensor in tensors.items():
            assert torch.equal(bits(reader.read(key)), bits(tensor)), key
            assert reader.index.keys[key].file == plan.weight_map[key]
        assert reader.bytes_read == sum(nbytes(t) for t in tensors.values())
    assert reader._boxes is None  # closed by the context manager


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ((slice(0, 4, 2),), "has step 2; only step 1 is read"),  # safetensors would ignore the step
        ((slice(0, 11),), "does not fit dim 0 of size 10"),  # safetensors would clamp
        ((slice(None), slice(-2, None)), "does not fit dim 1 of size 6"),  # negative bounds
        ((slice(5, 3),), "does not fit dim 0 of size 10"),  # start > stop
        ((slice(None), slice(None), slice(None)), "index has 3 slices but key 'w'"),
        ((3,), "index[0] must be a slice, got 3"),
    ],
)
def test_bad_index_is_refused(tmp_path, index, message) -> None:
    write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(10, 6)})
    with CheckpointReader(tmp_path / "x.safetensors") as reader, pytest.raises(CheckpointError) as info:
        reader.read("w", index)
    assert message in str(info.value)
    assert "F32[10, 6]" in str(info.value) and str(tmp_path) in str(info.value)


def test_missing_key_names_key_and_checkpoint(tmp_path) -> None:
    save_checkpoint(tmp_path / "ckpt", small_model())
    with CheckpointReader(tmp_path / "ckpt") as reader:
        for call in (reader.read, reader.shape, reader.dtype):
            with pytest.raises(CheckpointError) as info:
                call("model.layers.1.input_layernorm.weight")
            message = str(info.value)
            assert "'model.layers.1.input_layernorm.weight' is not in checkpoint" in message
            assert str(tmp_path / "ckpt") in message
            assert "model.layers.0.input_layernorm.weight" in message  # the near miss is suggested
        assert "lm_head.weight" in reader and "nope" not in reader


def test_close_then_read_reopens(tmp_path) -> None:
    write_safetensors(tmp_path / "x.safetensors", {"w": torch.arange(6)})
    reader = CheckpointReader(tmp_path / "x.safetensors")
    reader.read("w")
    assert reader._boxes is not None
    reader.close()
    assert reader._boxes is None
    assert torch.equal(reader.read("w", (slice(2, 4),)), torch.tensor([2, 3]))
    reader.close()
    reader.close()  # twice is fine
    assert "bytes_read=64" in repr(reader)


def test_written_file_is_readable_by_safetensors(tmp_path) -> None:
    tensors = small_model()
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "workbench": "0.1.0"})
    loaded = safetensors.torch.load_file(path)
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(bits(loaded[key]), bits(tensor)), key
    keys, metadata, problems = read_header(path)
    assert problems == []
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == metadata == {"format": "pt", "workbench": "0.1.0"}
        assert set(handle.keys()) == set(keys)
        for key in sorted(keys):
            view = handle.get_slice(key)
            assert view.get_dtype() == keys[key].dtype == safetensors_dtype(tensors[key].dtype), key
            assert view.get_shape() == list(keys[key].shape), key


def test_header_offsets_match_the_file_layout(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    tensors = {"a": torch.arange(5, dtype=torch.int64), "b": torch.ones(3, 2, dtype=torch.bfloat16)}
    write_safetensors(path, tensors)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    keys, _, _ = read_header(path)
    for key, info in keys.items():
        assert list(info.data_offsets) == header[key]["data_offsets"]
        begin, end = info.data_offsets
        assert raw[8 + n + begin : 8 + n + end] == bits(tensors[key]).numpy().tobytes()


def test_writer_takes_any_tensor(tmp_path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "transposed": base.t(),  # not contiguous: written contiguous
        "tied_a": base,  # the same memory twice (tied weights): cloned, not refused
        "tied_b": base,
        "top": base[:2],  # disjoint views of one buffer (keys split from a fused tensor)
        "bottom": base[2:],
        "grad": torch.ones(3, requires_grad=True),  # detached
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors)
    loaded = safetensors.torch.load_file(path)
    for key, tensor in tensors.items():
        assert torch.equal(loaded[key], tensor.detach()), key
    assert base.is_contiguous()  # the caller's tensor is untouched


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        ({"w": [1, 2]}, None, "key 'w' holds a list, not a tensor"),
        ({3: torch.zeros(1)}, None, "keys must be str, got 3"),
        ({"w": torch.zeros(1)}, {"step": 3}, "metadata must map str to str, got {'step': 3}"),
    ],
)
def test_writer_errors(tmp_path, tensors, metadata, message) -> None:
    with pytest.raises(CheckpointError) as info:
        write_safetensors(tmp_path / "x.safetensors", tensors, metadata)
    assert message in str(info.value) and "x.safetensors" in str(info.value)


def test_writer_error_on_a_missing_directory(tmp_path) -> None:
    with pytest.raises(CheckpointError) as info:
        write_safetensors(tmp_path / "nope" / "x.safetensors", {"w": torch.zeros(1)})
    assert "writing" in str(info.value) and "nope" in str(info.value)


def test_reader_on_single_file_directory(tmp_path) -> None:
    (tmp_path / "ckpt").mkdir()
    write_safetensors(tmp_path / "ckpt" / "model.safetensors", {"w": torch.arange(4)})
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert reader.index.total_size is None and reader.index.index_file is None
        assert torch.equal(reader.read("w"), torch.arange(4))
    assert read_checkpoint(tmp_path / "ckpt").files == ("model.safetensors",)


def test_the_reader_serves_empty_keys_own_tensors_and_closes_dropped_readers(tmp_path) -> None:
    """A zero-size trailing dim has no stride to read with; a small key is a tensor of its own (not a view of a
    64 MiB buffer that ``torch.save`` would write whole); a reader dropped unclosed leaves no file open."""
    import gc
    import os

    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    write_safetensors(tmp_path / "x.safetensors", {"e": torch.zeros(3, 0, dtype=torch.int32), "w": w,
                                                    "b": torch.tensor([1, 2], dtype=torch.int16)})
    with CheckpointReader(tmp_path / "x.safetensors") as reader:
        empty = reader.read("e")
        assert empty.shape == (3, 0) and empty.dtype == torch.int32
        assert reader.read("e", (slice(1, 2),)).shape == (1, 0)
        b = reader.read("b")
        assert torch.equal(b, torch.tensor([1, 2], dtype=torch.int16))
        assert b.untyped_storage().nbytes() == 4
        column = reader.read("w", (slice(None), slice(2, 3)))
        assert torch.equal(column, w[:, 2:3]) and column.is_contiguous() and column.untyped_storage().nbytes() == 16
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        CheckpointReader(tmp_path / "x.safetensors").read("w")
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds
