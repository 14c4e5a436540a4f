"""The index json and header parsing: round trip, total_size, and a clear error for every kind of damage."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest
import torch

from tests.io.support import edit_index, nbytes, save_checkpoint, small_model
from workbench.errors import CheckpointError
from workbench.io.files.file_plan import plan_files
from workbench.io.files.index import (
    INDEX_NAME,
    CheckpointIndex,
    KeyInfo,
    read_checkpoint,
    read_header,
    safetensors_dtype,
    scan_checkpoint,
    torch_dtype,
    write_index,
)
from workbench.io.files.write import write_safetensors

FIRST = "model-00001-of-00003.safetensors"
SECOND = "model-00002-of-00003.safetensors"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """Three files: embed+gate_up (rank 0), layernorm..mask (rank 1, one file), lm_head (rank 2)."""
    tensors = small_model()
    writers = {k: (0 if i < 2 else 1 if i < 5 else 2) for i, k in enumerate(tensors)}
    plan = save_checkpoint(tmp_path / "ckpt", tensors, writers)
    assert [f.name for f in plan.files] == [FIRST, SECOND, "model-00003-of-00003.safetensors"]
    return tmp_path / "ckpt"


def test_write_index_format(tmp_path) -> None:
    plan = plan_files({"b": 0, "a": 1, "c": 0}, {"a": 4, "b": 2, "c": 8}, ["b", "c", "a"])
    path = write_index(tmp_path, plan, {"format": "pt", "workbench_version": "0.1.0"})
    assert path == tmp_path / INDEX_NAME
    body = json.loads(path.read_text())
    assert body == {
        "metadata": {"total_size": 14, "format": "pt", "workbench_version": "0.1.0"},
        "weight_map": {
            "a": "model-00002-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors",
        },
    }
    assert list(body["weight_map"]) == ["a", "b", "c"]  # sorted
    assert path.read_text().startswith('{\n  "metadata": {\n    "total_size": 14,')  # indent 2
    assert [p.name for p in tmp_path.iterdir()] == [INDEX_NAME]  # no scratch file left


@pytest.mark.parametrize(
    ("directory", "extra", "message"),
    [
        ("present", {"total_size": "3"}, "must not set 'total_size'"),
        ("missing", None, "does not exist"),
    ],
)
def test_write_index_errors(tmp_path, directory, extra, message) -> None:
    plan = plan_files({"a": 0}, {"a": 1}, ["a"])
    with pytest.raises(CheckpointError, match=message):
        write_index(tmp_path if directory == "present" else tmp_path / "nope", plan, extra)


def test_read_checkpoint_round_trip(ckpt) -> None:
    tensors = small_model()
    index = read_checkpoint(ckpt)
    assert isinstance(index, CheckpointIndex)
    assert index.directory == ckpt and index.index_file == ckpt / INDEX_NAME
    assert index.total_size == sum(nbytes(t) for t in tensors.values()) == index.data_bytes
    assert index.files == (FIRST, SECOND, "model-00003-of-00003.safetensors")
    assert set(index.keys) == set(tensors) == set(index.weight_map)
    assert index.unlisted_keys == {}
    for key, tensor in tensors.items():
        info = index.keys[key]
        assert info.hf_key == key and info.file == index.weight_map[key]
        assert info.shape == tuple(tensor.shape) and torch_dtype(info.dtype) == tensor.dtype
        assert info.nbytes == nbytes(tensor) and info.numel == tensor.numel()
    assert index.keys["model.embed_tokens.weight"] == KeyInfo(
        "model.embed_tokens.weight", FIRST, "BF16", (8, 4), index.keys["model.embed_tokens.weight"].data_offsets
    )
    assert str(index) == (
        f"Checkpoint {ckpt}: 6 key(s) in 3 file(s), {index.data_bytes} data bytes "
        f"({INDEX_NAME}, total_size {index.total_size})"
    )
    assert str(index.keys["lm_head.weight"]) == "lm_head.weight: BF16[8, 4] in model-00003-of-00003.safetensors"
    assert read_checkpoint(ckpt / INDEX_NAME).keys == index.keys  # the index file itself is accepted


def test_file_metadata(tmp_path) -> None:
    save_checkpoint(tmp_path / "c", {"w": torch.zeros(2)}, metadata={"layout_hash": "abc", "format": "pt"})
    (tmp_path / "d").mkdir()
    write_safetensors(tmp_path / "d" / "model.safetensors", {"w": torch.zeros(2)})
    assert read_checkpoint(tmp_path / "c").file_metadata == {
        "model-00001-of-00001.safetensors": {"layout_hash": "abc", "format": "pt"}
    }
    assert read_checkpoint(tmp_path / "d").file_metadata == {"model.safetensors": {}}


@pytest.mark.parametrize("form", ["directory", "file"])
def test_single_file_checkpoints(tmp_path, form) -> None:
    tensors = {"a": torch.zeros(3, 2), "b": torch.arange(4)}
    (tmp_path / "c").mkdir()
    name = "model.safetensors" if form == "directory" else "weights.safetensors"
    write_safetensors(tmp_path / "c" / name, tensors)
    index = read_checkpoint(tmp_path / "c" if form == "directory" else tmp_path / "c" / name)
    assert index.weight_map == {"a": name, "b": name}
    assert index.files == (name,) and index.total_size is None and index.index_file is None
    assert index.keys["a"].dtype == "F32" and index.keys["b"].shape == (4,)


def test_key_in_file_but_not_in_weight_map_is_reported(ckpt) -> None:
    edit_index(ckpt, lambda body: body["weight_map"].pop("model.embed_tokens.weight"))
    index = read_checkpoint(ckpt)
    assert index.unlisted_keys == {FIRST: ("model.embed_tokens.weight",)}
    assert "model.embed_tokens.weight" not in index.keys


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def set_header(path: Path, edit) -> None:
    """Rewrite a file's header through ``edit(header)``, keeping the data bytes."""
    raw = path.read_bytes()
    n = header_length(path)
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


# Each case damages the 3-file checkpoint one way and lists fragments the error must contain.
CORRUPTIONS = [
    (
        "data truncated",  # the last bytes of a file are gone
        lambda d: truncate(d / SECOND, (d / SECOND).stat().st_size - 3),
        [str(SECOND), "truncated file", "tensors end at data byte", "re-save"],
    ),
    (
        "header truncated",  # the file stops inside its header
        lambda d: truncate(d / FIRST, 40),
        [FIRST, "truncated file", "runs past the end of the 40-byte file"],
    ),
    (
        "too short for a length",
        lambda d: truncate(d / FIRST, 5),
        [FIRST, "truncated file: 5 bytes, too short"],
    ),
    (
        "empty file",
        lambda d: truncate(d / FIRST, 0),
        [FIRST, "truncated file: 0 bytes"],
    ),
    (
        "header garbled",  # bytes inside the JSON overwritten
        lambda d: (d / FIRST).write_bytes(
            (d / FIRST).read_bytes()[:10] + b"\xff\x00garbage" + (d / FIRST).read_bytes()[19:]
        ),
        [FIRST, "corrupt header", "does not parse"],
    ),
    (
        "header length garbled",  # not a safetensors file at all
        lambda d: (d / FIRST).write_bytes(b"PK\x03\x04zipzipzip" + (d / FIRST).read_bytes()[12:]),
        [FIRST, "corrupt header", "beyond the 100000000-byte limit (MAX_HEADER_BYTES, safetensors' own)"],
    ),
    (
        "weight_map names a missing file",
        lambda d: edit_index(
            d, lambda b: b["weight_map"].update({"lm_head.weight": "model-00009-of-00009.safetensors"})
        ),
        ["model-00009-of-00009.safetensors", "missing file", "for 1 key(s), e.g. ['lm_head.weight']"],
    ),
    (
        "file deleted",
        lambda d: (d / SECOND).unlink(),
        [SECOND, "missing file", "3 key(s)"],
    ),
    (
        "key missing in header",  # the index lists a key its file does not hold
        lambda d: edit_index(d, lambda b: b["weight_map"].update({"model.ghost.weight": FIRST})),
        [FIRST, "key 'model.ghost.weight' is listed in the weight_map", "not in this file's header"],
    ),
    *(
        (
            f"__metadata__ is {bad!r}",  # safetensors refuses every one: only an object (or null) is metadata
            lambda d, bad=bad: set_header(d / FIRST, lambda h: h.update(__metadata__=bad)),
            [FIRST, "corrupt header", "__metadata__ must map str to str"],
        )
        for bad in ([], "", 0, False)
    ),
    (
        "data_offsets beyond the file end",
        lambda d: set_header(d / FIRST, lambda h: h["model.embed_tokens.weight"].update(data_offsets=[200, 264])),
        [FIRST, "truncated file", "tensors end at data byte 264"],
    ),
    (
        "data_offsets do not match shape",
        lambda d: set_header(d / FIRST, lambda h: h["model.embed_tokens.weight"].update(shape=[8, 5])),
        [FIRST, "key 'model.embed_tokens.weight' (BF16[8, 5]) needs 80 bytes", "span 64"],
    ),
    (
        "unknown dtype",
        lambda d: set_header(d / FIRST, lambda h: h["model.embed_tokens.weight"].update(dtype="F12")),
        [FIRST, "unknown dtype 'F12'"],
    ),
    (
        "trailing bytes",
        lambda d: (d / FIRST).write_bytes((d / FIRST).read_bytes() + b"\0" * 7),
        [FIRST, "7 unexpected bytes after the last tensor"],
    ),
    (
        "index not json",
        lambda d: (d / INDEX_NAME).write_text("{not json"),
        [INDEX_NAME, "corrupt index"],
    ),
    (
        "index without weight_map",
        lambda d: (d / INDEX_NAME).write_text('{"metadata": {}}'),
        [INDEX_NAME, "'weight_map' must be an object"],
    ),
    (
        "index deleted, shards remain",
        lambda d: (d / INDEX_NAME).unlink(),
        [f"no {INDEX_NAME} and no model.safetensors", "found 3 .safetensors file(s) without an index"],
    ),
]


@pytest.mark.parametrize(("damage", "fragments"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_read_checkpoint_names_the_damage(ckpt, damage, fragments) -> None:
    damage(ckpt)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(ckpt)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    _, problems = scan_checkpoint(ckpt)
    assert problems and all(p in message for p in problems)


def test_every_problem_is_listed(ckpt) -> None:
    truncate(ckpt / SECOND, 100)
    edit_index(ckpt, lambda b: b["weight_map"].update({"model.ghost.weight": FIRST}))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(ckpt)
    message = str(info.value)
    assert message.startswith(f"checkpoint {ckpt} has 2 problems:")
    assert SECOND in message and "model.ghost.weight" in message
    index, problems = scan_checkpoint(ckpt)
    assert len(problems) == 2
    assert index is not None and "lm_head.weight" in index.keys  # what could be parsed is kept
    assert "model.embed_tokens.weight" in index.keys


def test_missing_checkpoint(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint does not exist"):
        read_checkpoint(tmp_path / "nope")
    (tmp_path / ".nope.incomplete").mkdir()
    with pytest.raises(CheckpointError, match=r"an unfinished save was found at .*\.nope\.incomplete"):
        read_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=f"no {INDEX_NAME} and no model.safetensors$"):
        read_checkpoint(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        read_checkpoint(tmp_path / "notes.txt")


def test_read_header_directly(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": torch.zeros(2, 3, dtype=torch.float16), "b": torch.zeros(())}, {"k": "v"})
    keys, metadata, problems = read_header(path)
    assert problems == [] and metadata == {"k": "v"}
    assert keys["a"].shape == (2, 3) and keys["a"].dtype == "F16" and keys["a"].nbytes == 12
    assert keys["b"].shape == () and keys["b"].numel == 1


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("BF16", torch.bfloat16),
        ("F16", torch.float16),
        ("F32", torch.float32),
        ("F64", torch.float64),
        ("I64", torch.int64),
        ("I32", torch.int32),
        ("U8", torch.uint8),
        ("BOOL", torch.bool),
        ("F8_E4M3", torch.float8_e4m3fn),  # the DeepSeek-V3 fp8 weights
        ("F8_E5M2", torch.float8_e5m2),
        ("F8_E8M0", torch.float8_e8m0fnu),  # MX scales
    ],
)
def test_dtype_names(tmp_path, name, dtype) -> None:
    assert torch_dtype(name) is dtype
    assert safetensors_dtype(dtype) == name
    write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(4, dtype=torch.float32).to(dtype)})
    keys, _, _ = read_header(tmp_path / "x.safetensors")
    assert keys["w"].dtype == name  # what safetensors itself writes


def test_dtype_errors() -> None:
    with pytest.raises(CheckpointError, match="safetensors dtype 'F4' has no torch dtype here"):
        torch_dtype("F4")
    with pytest.raises(CheckpointError, match=r"torch\.qint8 cannot be stored in safetensors"):
        safetensors_dtype(torch.qint8)


PACKAGE = Path(__file__).resolve().parents[2] / "workbench" / "io"
PURE_MODULES = sorted([PACKAGE / "__init__.py", *(PACKAGE / "files").glob("*.py")])


@pytest.mark.parametrize("source", PURE_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_single_process_modules_never_import_torch_distributed(source: Path) -> None:
    """The file layer (io.files: plans, index, reads, writes, publish, ownership, host buffers) is single-process:
    no torch.distributed, no run layer."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert not name.startswith("torch.distributed"), f"{source.name} imports {name}"
            assert not name.startswith("workbench.run"), f"{source.name} imports {name}"


def test_long_problem_lists_are_elided(tmp_path) -> None:
    tensors = {f"k{i:02d}": torch.zeros(2) for i in range(30)}
    save_checkpoint(tmp_path / "c", tensors, max_shard_bytes=8)
    for file in (tmp_path / "c").glob("*.safetensors"):
        file.unlink()
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(tmp_path / "c")
    message = str(info.value)
    assert message.startswith(f"checkpoint {tmp_path / 'c'} has 30 problems:")
    assert message.count("missing file") == 20 and message.endswith("... and 10 more")


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "link"])
def test_an_index_naming_a_file_outside_the_folder_is_refused_without_opening_it(tmp_path, target) -> None:
    outside = tmp_path / "outside.safetensors"
    write_safetensors(outside, {"secret": torch.ones(2)})
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, {"w": torch.ones(2)})
    (ckpt / "link").symlink_to(outside)
    edit_index(ckpt, lambda body: body["weight_map"].update({"secret": target}))
    index, problems = scan_checkpoint(ckpt)
    refused = [p for p in problems if "refused (not opened)" in p]
    assert len(refused) == 1 and repr(target) in refused[0], problems
    assert "secret" not in index.keys
    with pytest.raises(CheckpointError, match="refused"):
        read_checkpoint(ckpt)


def test_a_header_with_a_non_string_dtype_is_a_problem_not_a_crash(tmp_path) -> None:
    header = json.dumps({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    keys, _, problems = read_header(path)
    assert keys == {} and any("unknown dtype ['F32']" in p for p in problems), problems


def test_total_size_as_a_whole_float_is_read(ckpt) -> None:
    """Some writers store ``total_size`` as a JSON float (``1234.0``): a whole number is accepted."""
    total = read_checkpoint(ckpt).total_size
    edit_index(ckpt, lambda body: body["metadata"].update(total_size=float(total)))
    index = read_checkpoint(ckpt)
    assert index.total_size == total and type(index.total_size) is int
