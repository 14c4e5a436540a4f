"""The HF index (``model.safetensors.index.json``) and safetensors headers, read without loading tensors.

A safetensors file is ``[u64 little-endian header length n][n bytes of JSON header][data]``; the header
maps every key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data
start) plus an optional ``"__metadata__"`` of str -> str. ``read_checkpoint`` parses the index and every
header directly, checks them against each other and the file sizes, and names the file and the problem
when something is off (missing, truncated, corrupt). Both are parsed within the bounds of
``workbench.io.files.limits`` (size, nesting depth, no NaN/Infinity, sizes and offsets in u64), so a hostile
file is a named problem, never another exception.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.errors import CheckpointError
from workbench.io.files import limits
from workbench.io.files.file_plan import FilePlan
from workbench.io.files.write import fsync_dir, fsync_file

__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "CheckpointIndex",
    "KeyInfo",
    "cached_checkpoint",
    "outside_folder",
    "read_checkpoint",
    "read_header",
    "read_index",
    "safetensors_dtype",
    "scan_checkpoint",
    "torch_dtype",
    "write_index",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
_MAX_LISTED = 20  # problems shown in one error message
_U64 = limits.MAX_STORED_INT

# safetensors dtype string -> bits per element (sizes), and -> torch dtype where torch has one.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32,
    "U64": 64, "I64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
_TO_TORCH: dict[str, torch.dtype] = {
    s: getattr(torch, name) for s, name in _TORCH_NAMES.items() if isinstance(getattr(torch, name, None), torch.dtype)
}
_FROM_TORCH: dict[torch.dtype, str] = {d: s for s, d in _TO_TORCH.items()}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string: ``torch_dtype("BF16") is torch.bfloat16``."""
    try:
        return _TO_TORCH[dtype]
    except KeyError:
        raise CheckpointError(
            f"safetensors dtype {dtype!r} has no torch dtype here; known: {sorted(_TO_TORCH)}"
        ) from None


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype: ``safetensors_dtype(torch.bfloat16) == "BF16"``."""
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise CheckpointError(f"torch dtype {dtype} cannot be stored in safetensors") from None


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """Where one HF key lives: its file, safetensors dtype string, shape, and data byte range in the file.

    ``data_offsets`` are relative to the start of the data section, as in the header.
    """

    hf_key: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return self.data_offsets[1] - self.data_offsets[0]

    def __str__(self) -> str:
        return f"{self.hf_key}: {self.dtype}{list(self.shape)} in {self.file}"


@dataclass(frozen=True, slots=True)
class CheckpointIndex:
    """A checkpoint's index and headers, parsed and cross-checked; no tensor data is loaded.

    Attributes:
        directory: the folder holding the files.
        weight_map: ``{hf_key: file name}`` (from the index, or every key of a lone file).
        total_size: ``metadata.total_size`` of the index (None without an index or without the field).
        files: the file names the weight map refers to, sorted.
        keys: ``{hf_key: KeyInfo}`` for every key of the weight map, in weight-map order.
        file_metadata: ``{file name: __metadata__ of its header}`` ({} where a header has none).
        index_file: the index json, or None for a single-file checkpoint.
        unlisted_keys: ``{file name: keys in its header that the weight map does not list}`` (HF loaders
            ignore them; usually a sign of a stale index).
        file_ids: ``{file name: file_id(...)}`` of each file as its header was read: a reader that opens the file
            later checks it is still that file (``box_reads``), not one another save put there since.
    """

    directory: Path
    weight_map: dict[str, str]
    total_size: int | None
    files: tuple[str, ...]
    keys: dict[str, KeyInfo]
    file_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    index_file: Path | None = None
    unlisted_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    file_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def path_of(self, file: str) -> Path:
        """The full path of one of ``files``."""
        return self.directory / file

    @property
    def data_bytes(self) -> int:
        """Sum of the tensor bytes of every key in the weight map (what ``total_size`` should say)."""
        return sum(info.nbytes for info in self.keys.values())

    def __str__(self) -> str:
        total = "no total_size" if self.total_size is None else f"total_size {self.total_size}"
        source = self.index_file.name if self.index_file is not None else "no index"
        return (
            f"Checkpoint {self.directory}: {len(self.keys)} key(s) in {len(self.files)} file(s), "
            f"{self.data_bytes} data bytes ({source}, {total})"
        )

    def __repr__(self) -> str:
        return f"CheckpointIndex(directory={str(self.directory)!r}, keys={len(self.keys)}, files={len(self.files)})"


def write_index(
    directory: Path | str,
    file_plan: FilePlan,
    metadata_extra: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model.safetensors.index.json`` for ``file_plan`` into ``directory``, fsynced; return its path.

    The json is ``{"metadata": {"total_size": ..., **metadata_extra}, "weight_map": {...}}`` (indent 2,
    weight-map keys sorted). It is written to a hidden sibling and renamed, so a reader never sees half
    an index.

    Raises:
        CheckpointError: ``metadata_extra`` redefines ``total_size``, or the directory is missing.
    """
    directory = Path(directory)
    extra = dict(metadata_extra or {})
    if "total_size" in extra:
        raise CheckpointError("metadata_extra must not set 'total_size'; it is computed from the file plan")
    if not directory.is_dir():
        raise CheckpointError(f"cannot write the index: directory {directory} does not exist")
    body = {
        "metadata": {"total_size": int(file_plan.total_size), **extra},
        "weight_map": {k: file_plan.weight_map[k] for k in sorted(file_plan.weight_map)},
    }
    path = directory / INDEX_NAME
    scratch = directory / f".{INDEX_NAME}.tmp"
    scratch.write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    fsync_file(scratch)
    os.replace(scratch, path)
    fsync_dir(directory)
    return path


def file_id(st: os.stat_result) -> tuple[int, ...]:
    """What tells one file's contents from another's at one path: device, inode, size and modification time (an
    atomic replace is a new inode; a rewrite in place, an append or a truncation changes the size or the time). Not
    the change time: a hard link, a ``chmod`` or an extended attribute changes it and no byte."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def changed_since_parsed(index: CheckpointIndex, file: str, st: os.stat_result) -> str | None:
    """Why the file ``st`` describes is not the ``file`` of ``index`` whose header was parsed (another save
    replaced it, or it was rewritten, since: the index's offsets would read other bytes), or None (also where the
    index kept no record of it)."""
    expected = index.file_ids.get(file)
    if expected is None:
        return None
    now = file_id(st)
    if now == expected:
        return None
    how = "replaced by another file" if now[:2] != expected[:2] else "rewritten in place"
    return (f"{index.path_of(file)}: {how} since its header was read (another save to this checkpoint during the "
            "load?); its bytes no longer match the index: load again once the checkpoint is complete")


def read_header(path: Path | str) -> tuple[dict[str, KeyInfo], dict[str, str], list[str]]:
    """Parse one safetensors header: ``(keys, __metadata__, problems)``; tensor data is not read.

    ``problems`` lists what is wrong, each naming the file (truncated, corrupt header, bad offsets). With
    a problem in the header itself, ``keys`` is empty.
    """
    keys, metadata, problems, _ = _read_header(Path(path))
    return keys, metadata, problems


def _read_header(path: Path) -> tuple[dict[str, KeyInfo], dict[str, str], list[str], tuple[int, ...] | None]:
    """``read_header`` and the ``file_id`` of the file it read (None where it could not be opened)."""
    name = path.name
    problems: list[str] = []
    cap = limits.MAX_HEADER_BYTES
    try:
        with open(path, "rb", buffering=0) as f:
            identity = file_id(os.fstat(f.fileno()))
            size = identity[2]
            if hasattr(os, "posix_fadvise"):  # no readahead: it would read (and mark for more) tensor data
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            prefix = f.read(8)
            if len(prefix) < 8:
                short = f"{path}: truncated file: {size} bytes, too short for the 8-byte header length"
                return {}, {}, [short], identity
            (n,) = struct.unpack("<Q", prefix)
            if n > cap:
                problem = (
                    f"{path}: corrupt header: header length {n} bytes is beyond the {cap}-byte limit "
                    "(MAX_HEADER_BYTES, safetensors' own); not a safetensors file, or garbled"
                )
                return {}, {}, [problem], identity
            if 8 + n > size:
                problem = (
                    f"{path}: truncated file: header length {n} bytes runs past the end of the {size}-byte "
                    "file; the write was interrupted, re-save the checkpoint"
                )
                return {}, {}, [problem], identity
            raw = f.read(n)
    except (OSError, ValueError) as exc:  # ValueError: a name with a NUL byte
        return {}, {}, [f"{path}: cannot read: {exc}"], None
    try:
        header = limits.parse_json(raw)
    except ValueError as exc:
        return {}, {}, [f"{path}: corrupt header: the {n}-byte JSON header does not parse: {exc}"], identity
    if not isinstance(header, dict):
        return {}, {}, [f"{path}: corrupt header: expected a JSON object, got {type(header).__name__}"], identity

    metadata = header.pop("__metadata__", None)
    if metadata is None:  # absent or null: what safetensors writes for no metadata
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        problems.append(f"{path}: corrupt header: __metadata__ must map str to str, got {metadata!r:.200}")
        metadata = {}
    data_len = size - 8 - n
    keys: dict[str, KeyInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        info = _parse_entry(path, name, key, entry, problems)
        if info is None:
            continue
        keys[key] = info
        spans.append((info.data_offsets[0], info.data_offsets[1], key))
    spans.sort()
    end = 0
    for begin, stop, key in spans:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a {begin - end}-byte gap before it"
            problems.append(f"{path}: corrupt header: key {key!r} at data_offsets [{begin}, {stop}] {what}")
        end = max(end, stop)
    if end > data_len:
        problems.append(
            f"{path}: truncated file: tensors end at data byte {end} but the file holds only {data_len} data "
            f"bytes ({size} bytes in all); the write was interrupted, re-save the checkpoint"
        )
    elif end < data_len:
        problems.append(f"{path}: corrupt file: {data_len - end} unexpected bytes after the last tensor")
    return keys, {str(k): v for k, v in metadata.items()}, problems, identity


def _parse_entry(path: Path, name: str, key: str, entry: object, problems: list[str]) -> KeyInfo | None:
    fast = _parse_well_formed(name, key, entry)  # one pass for the common case; the checks below name a problem
    if fast is not None:
        return fast
    if not isinstance(entry, dict):
        problems.append(f"{path}: corrupt header: key {key!r} has entry {entry!r:.120}, expected an object")
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        problems.append(f"{path}: corrupt header: key {key!r} has unknown dtype {dtype!r}")
        return None
    if not isinstance(shape, list) or not all(_is_u64(s) for s in shape):
        problems.append(
            f"{path}: corrupt header: key {key!r} has shape {shape!r:.120}, expected a list of integer sizes "
            f"in [0, {_U64}]"
        )
        return None
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        problems.append(
            f"{path}: corrupt header: key {key!r} has data_offsets {offsets!r:.120}, expected [begin, end] of "
            f"integers in [0, {_U64}]"
        )
        return None
    if offsets[0] > offsets[1]:
        problems.append(f"{path}: corrupt header: key {key!r} has data_offsets {offsets}, which end before they begin")
        return None
    expected = (math.prod(shape) * _DTYPE_BITS[dtype] + 7) // 8
    if offsets[1] - offsets[0] != expected:
        problems.append(
            f"{path}: corrupt header: key {key!r} ({dtype}{shape}) needs {expected} bytes but its data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}"
        )
        return None
    return KeyInfo(hf_key=key, file=name, dtype=dtype, shape=tuple(shape), data_offsets=(offsets[0], offsets[1]))


def _is_u64(value: object) -> bool:
    """An integer a safetensors file may hold as a size or offset (JSON true/false are not integers)."""
    return type(value) is int and 0 <= value <= _U64


def _parse_well_formed(name: str, key: str, entry: object) -> KeyInfo | None:
    """The KeyInfo of an entry with nothing wrong, or None (the caller then finds and names the problem)."""
    if type(entry) is not dict:
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(dtype) is not str or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    bits = _DTYPE_BITS.get(dtype)
    begin, end = offsets
    if bits is None or type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= _U64:
        return None
    n = 1
    for size in shape:
        if type(size) is not int or not 0 <= size <= _U64:
            return None
        n *= size
    if end - begin != (n * bits + 7) // 8:
        return None
    return KeyInfo(hf_key=key, file=name, dtype=dtype, shape=tuple(shape), data_offsets=(begin, end))


def _locate(path: Path) -> tuple[Path, Path | None, Path | None, list[str]]:
    """``(directory, index file, lone safetensors file, problems)`` for a checkpoint path."""
    if path.is_file():
        if path.name == INDEX_NAME:
            return path.parent, path, None, []
        if path.suffix == ".safetensors":
            return path.parent, None, path, []
        return path.parent, None, None, [f"{path}: not a checkpoint: expected a directory or a .safetensors file"]
    if not path.exists():
        hint = ""
        temporary = path.parent / f".{path.name}.incomplete"
        if temporary.exists():
            hint = f"; an unfinished save was found at {temporary} (it was never published)"
        return path, None, None, [f"{path}: checkpoint does not exist{hint}"]
    if (path / INDEX_NAME).is_file():
        return path, path / INDEX_NAME, None, []
    if (path / SINGLE_FILE_NAME).is_file():
        return path, None, path / SINGLE_FILE_NAME, []
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    found = f"; found {len(shards)} .safetensors file(s) without an index, e.g. {shards[:3]}" if shards else ""
    return path, None, None, [f"{path}: no {INDEX_NAME} and no {SINGLE_FILE_NAME}{found}"]


def read_index(index_file: Path | str) -> tuple[dict[str, str], int | None, list[str]]:
    """Parse ``model.safetensors.index.json``: ``(weight_map, total_size, problems)``; never raises.

    The file is refused unread above ``limits.MAX_INDEX_BYTES`` and parsed with ``limits.parse_json`` (depth
    bound, no NaN/Infinity). ``problems`` name the file and what is wrong; an unusable weight map gives
    ``{}``, a bad ``metadata.total_size`` (not an integer in [0, 2**64-1]) gives None.
    """
    index_file = Path(index_file)
    try:
        body = limits.parse_json(limits.read_capped(index_file, limits.MAX_INDEX_BYTES, "MAX_INDEX_BYTES"))
    except OSError as exc:
        return {}, None, [f"{index_file}: cannot read: {exc}"]
    except ValueError as exc:
        return {}, None, [f"{index_file}: corrupt index: {exc}"]
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        return {}, None, [f"{index_file}: corrupt index: 'weight_map' must be an object of key -> file name"]
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return weight_map, None, [f"{index_file}: corrupt index: 'metadata' is {metadata!r:.80}, not an object"]
    total = (metadata or {}).get("total_size")
    if total is None:
        return weight_map, None, []
    if type(total) is float and total.is_integer():
        total = int(total)  # 123.0: a size some writers store as a JSON float
    if not _is_u64(total):
        return weight_map, None, [
            f"{index_file}: corrupt index: metadata.total_size {total!r:.60} is not an integer byte count in "
            f"[0, {_U64}]"
        ]
    return weight_map, total, []


def _read_index(index_file: Path, problems: list[str]) -> tuple[dict[str, str], int | None]:
    weight_map, total, found = read_index(index_file)
    problems.extend(found)
    return weight_map, total


def outside_folder(directory: Path, file: str) -> str:
    """Why a weight-map file name is not a plain file inside ``directory`` ('' when it is). A symbolic link may point
    inside the folder, or, in a Hugging Face hub cache snapshot (``REPO/snapshots/REV``, what ``snapshot_download``
    returns), into that repo's ``blobs`` folder, where the hub keeps the files its links name."""
    if not file or file in (".", "..") or any(c in file for c in "/\\\0") or Path(file).is_absolute():
        return "is not a plain file name in the checkpoint folder"
    target = directory / file
    if target.is_symlink():
        try:
            real, folder = target.resolve(), directory.resolve()
        except (OSError, RuntimeError):  # a loop of links
            return "is a symbolic link that does not resolve"
        allowed = [folder] + ([folder.parent.parent / "blobs"] if folder.parent.name == "snapshots" else [])
        if not any(real.is_relative_to(place) for place in allowed):
            return ("is a symbolic link pointing outside the checkpoint folder (and outside the blobs of a Hugging "
                    "Face cache snapshot)")
    return ""


def scan_checkpoint(path: Path | str) -> tuple[CheckpointIndex | None, tuple[str, ...]]:
    """Parse a checkpoint like ``read_checkpoint`` but collect every problem instead of raising.

    Returns ``(index, problems)``: ``index`` is None when no index or file could be found at all; with
    problems it holds what could be parsed (keys of broken files are missing from ``keys``).
    """
    path = Path(path)
    directory, index_file, lone_file, problems = _locate(path)
    if index_file is None and lone_file is None:
        return None, tuple(problems)
    total_size: int | None = None
    if index_file is not None:
        weight_map, total_size = _read_index(index_file, problems)
        files = tuple(sorted(set(weight_map.values())))
    else:
        files = (lone_file.name,) if lone_file is not None else ()
        weight_map = {}

    keys: dict[str, KeyInfo] = {}
    file_metadata: dict[str, dict[str, str]] = {}
    unlisted: dict[str, tuple[str, ...]] = {}
    file_ids: dict[str, tuple[int, ...]] = {}
    headers: dict[str, dict[str, KeyInfo]] = {}
    keys_of_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        keys_of_file.setdefault(file, []).append(key)
    for file in files:
        file_path = directory / file
        escape = outside_folder(directory, file)
        if escape:
            problems.append(f"{index_file}: index names {file!r}, which {escape}; refused (not opened)"
                            if index_file is not None else f"{directory / file}: {escape}; refused (not opened)")
            continue
        if not file_path.is_file():
            named = keys_of_file.get(file, [])
            problems.append(
                f"{file_path}: missing file: the weight_map of {index_file} names it for {len(named)} key(s), "
                f"e.g. {named[:3]}"
            )
            continue
        header, metadata, header_problems, identity = _read_header(file_path)
        problems.extend(header_problems)
        if identity is not None:
            file_ids[file] = identity
        file_metadata[file] = metadata
        if header or not header_problems:  # an unreadable header is reported once, not once per key
            headers[file] = header
    if index_file is None and files:
        weight_map = dict.fromkeys(headers.get(files[0], {}), files[0])
    for key, file in weight_map.items():
        header = headers.get(file)
        if header is None:
            continue
        info = header.get(key)
        if info is None:
            problems.append(
                f"{directory / file}: key {key!r} is listed in the weight_map of {index_file} but is not in "
                "this file's header; the index and the files come from different saves"
            )
            continue
        keys[key] = info
    for file, header in headers.items():
        extra = tuple(k for k in header if weight_map.get(k) != file)
        if extra:
            unlisted[file] = extra
    index = CheckpointIndex(
        directory=directory,
        weight_map=dict(weight_map),
        total_size=total_size,
        files=files,
        keys=keys,
        file_metadata=file_metadata,
        index_file=index_file,
        unlisted_keys=unlisted,
        file_ids=file_ids,
    )
    return index, tuple(problems)


def read_checkpoint(path: Path | str) -> CheckpointIndex:
    """Parse a checkpoint's index and every safetensors header; raise if anything is damaged.

    ``path`` is a directory with ``model.safetensors.index.json``, a directory with a single
    ``model.safetensors`` (no index), or one ``.safetensors`` file.

    Raises:
        CheckpointError: listing every problem found, each naming the file and what is wrong: a missing
            index or file, a weight_map naming a missing file, a key absent from its file's header, a
            truncated file (header or data past the end), a corrupt (unparsable) header.
    """
    index, problems = scan_checkpoint(path)
    if problems:
        if len(problems) == 1:
            raise CheckpointError(problems[0])
        shown = problems[:_MAX_LISTED]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        listed = "\n  - ".join(shown)
        raise CheckpointError(f"checkpoint {path} has {len(problems)} problems:\n  - {listed}{more}")
    if index is None:  # unreachable: no index comes with a problem
        raise CheckpointError(f"{path}: not a checkpoint")
    return index


_CACHE_SIZE = 8  # checkpoints whose parsed index is kept (a few KiB per thousand keys)
_cache: OrderedDict[Path, tuple[tuple, CheckpointIndex]] = OrderedDict()
_cache_lock = threading.Lock()
_SETTLED_NS = 1_000_000_000  # a file changed less than this before parsing began may still be changing


def _signature(path: Path, index: CheckpointIndex | None) -> tuple | None:
    """What must not have changed for a parsed ``index`` of ``path`` to still hold: where ``_locate`` finds the
    index or lone file, and the inode, size and change times of that file and of every data file. An atomic
    replace (a new inode), an append, a truncation or a rewrite in place (``st_ctime_ns``) each change it. None
    where a file is gone."""
    _, index_file, lone_file, problems = _locate(path)
    if problems:
        return None
    names = [index_file or lone_file] + ([index.path_of(f) for f in index.files] if index is not None else [])
    try:
        stats = tuple(_fresh_stat(n) for n in names)
    except OSError:
        return None
    return (index_file, lone_file, *((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats))


def _signs_parsed_files(signature: tuple, index: CheckpointIndex) -> bool:
    """Whether the data files of ``signature`` (made for ``index``) are the files ``index`` parsed: the same device,
    inode, size and modification time as its ``file_ids``."""
    stats = signature[3:]
    return len(stats) == len(index.files) and all(
        stat[:4] == index.file_ids.get(file) for file, stat in zip(index.files, stats))


def _fresh_stat(path: Path) -> os.stat_result:
    """``fstat`` of the file freshly opened: on NFS an ``open`` revalidates the attributes the client cached
    (close-to-open consistency), so another node's rewrite shows; a plain ``stat`` may answer from that cache."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def cached_checkpoint(path: Path | str) -> CheckpointIndex:
    """``read_checkpoint``, reusing the index parsed by an earlier call for the same path while none of its files
    changed (``_signature``: a few ``stat`` calls instead of parsing every header again; the repeated loads of a
    training job, or of a notebook, parse a checkpoint of thousands of keys once). The index returned is shared:
    do not change its dicts. The path is kept as given, made absolute but not normalized (``a/link/../b`` is
    where the system finds it, not ``a/b``). An index parsed while a file was changing (its change time within
    ``_SETTLED_NS`` of the parse, by this machine's clock) is not kept.

    Raises:
        CheckpointError: as ``read_checkpoint`` (a damaged checkpoint is never cached).
    """
    key = Path(path)
    if not key.is_absolute():
        key = Path.cwd() / key  # not os.path.abspath: it drops "link/.." as text, not as the system resolves it
    with _cache_lock:
        entry = _cache.get(key)
    if entry is not None:
        signature, index = entry
        if _signature(key, index) == signature:
            with _cache_lock:
                if key in _cache:
                    _cache.move_to_end(key)
            return index
    started = time.time_ns()
    before = _signature(key, None)
    index = read_checkpoint(key)
    signature = _signature(key, index)
    # kept only when no file changed since a while before parsing began (one rewritten while its header was
    # parsed would otherwise leave a stale index behind a signature that matches the new file), and when the files
    # the signature saw are the very files parsed: a folder swapped or a link turned between the parse and the
    # signature keeps its files' old change times, and a kept index of the old files would refuse every later load
    if (signature is not None and before is not None and signature[:3] == before[:3]
            and max(s[4] for s in signature[2:]) < started - _SETTLED_NS and _signs_parsed_files(signature, index)):
        with _cache_lock:
            _cache[key] = (signature, index)
            _cache.move_to_end(key)
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return index
