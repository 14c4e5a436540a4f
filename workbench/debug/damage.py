"""Keys a checkpoint names whose bytes cannot be read: their file is missing, its header does not parse, or the
file ends before their data. A diff reports each such key once, by what happened to its file, and compares the
rest; nothing here reads tensor data (one 8-byte header length per damaged file).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from stat import S_ISREG

from workbench.debug.findings import Finding, key_named_in
from workbench.debug.source import Source
from workbench.io.files.index import CheckpointIndex, read_header

__all__ = ["damaged_keys", "readable_keys", "unread_files_hint"]



def damaged_keys(source: Source) -> dict[str, Finding | None]:
    """``{key: finding}`` for every key of ``source`` that cannot be read; the finding is None for a key the
    integrity scan already named (listed in the index, absent from its file's header). A source that is not a
    checkpoint has no damaged keys.
    """
    index: CheckpointIndex | None = getattr(source, "index", None)
    if index is None:
        return {}
    out: dict[str, Finding | None] = {}
    lost: dict[str, list[str]] = {}
    for key, file in index.weight_map.items():
        if key not in index.keys:
            lost.setdefault(file, []).append(key)
    for file, keys in lost.items():
        path = index.path_of(file)
        if not path.is_file():
            for key in keys:
                out[key] = Finding("missing_key", key, {"file": file, "detail": "the index names this file for the "
                                                        "key, and the file is missing"},
                                   f"the data file {file} is missing ({len(keys)} key(s) in it): copy it from where "
                                   "the checkpoint came from (an incomplete copy or upload?), or re-save")
            continue
        header, _, problems = _header(path)
        for key in keys:
            if key in header:
                continue
            if header or not problems:
                out[key] = None  # in the index, not in the file's header: the integrity scan names it
                continue
            detail = problems[0].partition(": ")[2]
            if detail.startswith("cannot read"):
                out[key] = Finding("missing_key", key, {"file": file, "detail": detail},
                                   f"{file} cannot be read ({len(keys)} key(s) in it, not compared): fix its "
                                   "permissions (or the I/O error), then diagnose again")
                continue
            out[key] = Finding("corrupt_header", key, {"file": file, "detail": problems[0].partition(": ")[2]},
                               f"the header of {file} does not parse, so none of its {len(keys)} key(s) can be read: "
                               "re-save the checkpoint, or restore that file")
    if index.index_file is None:  # one file, no weight_map: its keys with a damaged header entry are named there
        for file in index.files:
            _, _, problems = _header(index.path_of(file))
            for problem in problems:
                detail = problem.partition(": ")[2]
                key = key_named_in(detail, "corrupt header: ")
                if key is not None and key not in index.keys:
                    out[key] = Finding("corrupt_header", key, {"file": file, "detail": detail},
                                       f"the header of {file} names this key, but its entry is damaged, so its bytes "
                                       "cannot be read: re-save the checkpoint, or restore that file")
    data = {file: _data_bytes(index.path_of(file)) for file in index.files}
    for key, info in index.keys.items():
        have = data.get(info.file)
        if have is not None and info.data_offsets[1] > have:
            part = max(0, have - info.data_offsets[0])
            out[key] = Finding("truncated_file", key, {
                "file": info.file, "detail": f"its data ends at data byte {info.data_offsets[1]}, the file holds "
                f"{max(0, have)}: {part} of its {info.nbytes} bytes are there"},
                f"{info.file} was cut short (an interrupted write or copy): re-save the checkpoint, or restore the "
                "file; the keys before the cut are compared as usual")
    return out


def unread_files_hint(source: Source, findings: Sequence[Finding]) -> str:
    """For a key the checkpoint does not list: the hint that it may be in a file whose keys could not be listed (a
    header that does not parse, shards an empty or broken index does not name), or '' when there is none. A
    checkpoint whose index maps keys says what it holds: then ''."""
    index: CheckpointIndex | None = getattr(source, "index", None)
    if index is None or (index.index_file is not None and index.weight_map):
        return ""
    read = {info.file for info in index.keys.values()}
    files = sorted({file for f in findings if isinstance(file := f.evidence.get("file"), str) and f.key == file
                    and file.endswith(".safetensors") and file not in read and "side" not in f.evidence
                    and f.kind in ("corrupt_header", "truncated_file", "index_inconsistent")})
    if not files:
        return ""
    named = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return (f"no key of {named} could be listed (see the findings about it), so this key may be there: fix that "
            "first (restore the file, or rebuild the index), then diagnose again")


def readable_keys(source: Source, damaged: dict[str, Finding | None]) -> list[str]:
    """The keys of ``source`` whose bytes can be read."""
    return [k for k in source.metas() if k not in damaged]


def _header(path: Path) -> tuple[dict, dict, list[str]]:
    try:
        return read_header(path)
    except Exception as exc:  # a hostile header workbench.io's parser does not survive
        return {}, {}, [f"{path}: corrupt header: {type(exc).__name__}: {exc}"]


def _data_bytes(path: Path) -> int | None:
    """Bytes after the header of a safetensors file (None when it cannot be opened or has no 8-byte length)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # non-blocking: a FIFO in a file's place would wait forever
    except (OSError, ValueError):  # ValueError: a name with a NUL byte
        return None
    try:
        stat = os.fstat(fd)
        if not S_ISREG(stat.st_mode):  # a FIFO, a device, a directory: the integrity scan names the file
            return None
        size = stat.st_size
        head = os.pread(fd, 8, 0)
    except OSError:  # a directory where the file should be, or a read error: the integrity scan names the file
        return None
    finally:
        os.close(fd)
    if len(head) < 8:
        return None
    return size - 8 - struct.unpack("<Q", head)[0]
