"""Integrity of one checkpoint on disk, as findings: headers, index, files, unfinished saves.

Builds on ``workbench.io.files.index.scan_checkpoint`` (which parses every header with its length and offsets
bounds-checked before anything is allocated) and adds what a debugger needs on top: index paths that
would escape the folder (refused before any file is opened), keys the index does not list,
``metadata.total_size`` against the headers, and unfinished saves (``.NAME.incomplete``) beside the path.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from workbench.debug.findings import Finding, key_named_in
from workbench.io.files.complete import OLD_SUFFIX
from workbench.io.files.index import (
    INDEX_NAME,
    CheckpointIndex,
    KeyInfo,
    outside_folder,
    read_header,
    read_index,
    scan_checkpoint,
)
from workbench.io.files.publish_types import INCOMPLETE_SUFFIX, is_temporary_path, temporary_path

__all__ = ["ScanResult", "scan_for_findings"]

_LINK_OUT = re.compile(r"names '([^'/\\\\]+)', which is a symbolic link pointing outside")
_UNREADABLE = ("does not exist", "not a checkpoint", "cannot read", f"no {INDEX_NAME} and no")


@dataclass(frozen=True, slots=True)
class ScanResult:
    """A checkpoint's parsed index (None when nothing could be parsed), its findings, and why it is unreadable."""

    index: CheckpointIndex | None
    findings: tuple[Finding, ...]
    error: str = ""


def _classify(problem: str, directory: Path) -> Finding:
    """One problem string of ``scan_checkpoint`` -> a Finding (the io layer words each problem by its kind)."""
    where, _, detail = problem.partition(": ")
    link = _LINK_OUT.search(detail)
    if link:  # a plain file name of the folder whose file is a link out of it: the io layer refused to open it
        return _link_out(directory, link.group(1))
    file = _relative(Path(where), directory)
    named = key_named_in(detail)
    key = named if named is not None and "weight_map" in detail else file
    evidence = {"file": file, "detail": detail}
    if detail.startswith("truncated file"):
        return Finding("truncated_file", key, evidence, "the write was interrupted: re-save the checkpoint, or "
                       "restore this file from the copy it was made from")
    if detail.startswith(("corrupt header", "corrupt file")):
        return Finding("corrupt_header", key, evidence, "this file is not a valid safetensors file any more: "
                       "re-save it; do not load this checkpoint")
    if detail.startswith("cannot read"):
        return Finding("index_inconsistent", key, evidence, f"{file} cannot be opened or read (its permissions, or "
                       "an I/O error): fix that, then diagnose again; the other files were compared")
    if detail.startswith("corrupt index"):
        return Finding("index_inconsistent", key, evidence, "the index does not parse as an HF index (damaged, "
                       "or crafted): rebuild it from the files' headers, or re-save; do not load it")
    if detail.startswith("missing file"):
        return Finding("index_inconsistent", key, evidence, "copy the missing file (an incomplete copy or "
                       "upload?), or re-save the checkpoint")
    return Finding("index_inconsistent", key, evidence, "the index and the files come from different saves: "
                   "re-save, or rebuild the index from the files' headers")


def _is_link_out(directory: Path, name: str) -> bool:
    """True when ``name`` is a plain file name of ``directory`` (not a path) whose file is a symbolic link."""
    try:
        return len(Path(name).parts) == 1 and name not in (".", "..") and (directory / name).is_symlink()
    except (OSError, ValueError):
        return False


def _link_out(directory: Path, name: str) -> Finding:
    """A file of the folder that is a symbolic link out of it (a Hugging Face cache snapshot is made of them)."""
    try:
        target = str((directory / name).resolve())
    except (OSError, RuntimeError, ValueError):
        target = "a path that does not resolve"
    return Finding("index_inconsistent", name, {"file": name, "detail": f"a symbolic link to {target}, outside the "
                   "checkpoint folder; it was not opened"},
                   "workbench opens no file outside the checkpoint folder (but for a Hugging Face cache snapshot's "
                   "links into its repo's blobs), and this one links out of it: diagnose a copy with the links "
                   "resolved (cp -rL FOLDER COPY); nothing says the checkpoint itself is wrong")


def _relative(path: Path, directory: Path) -> str:
    try:
        return str(path.relative_to(directory))
    except ValueError:
        return str(path)


def _escaping(directory: Path, files: set[str]) -> list[str]:
    """Weight-map file names that leave ``directory`` (absolute, ``..``, or a link out of it other than into a
    Hugging Face cache snapshot's blobs): ``outside_folder``, the rule the loader keeps."""
    bad = []
    for name in sorted(files):
        try:
            if outside_folder(directory, name):
                bad.append(name)
        except (OSError, ValueError):  # ValueError: a NUL byte in the name
            bad.append(name)
    return bad


def _unfinished_hint(path: Path, moved_aside: bool) -> str:
    """What to do about an unfinished save beside ``path``: which complete checkpoint there is, if any."""
    if path.exists():
        return (f"a later save to {path.name} never finished; {path.name} itself is the previous complete "
                "checkpoint. Find why that save failed, then remove the leftover (wb.clean_incomplete)")
    if moved_aside:
        return (f"a save to {path.name} stopped while publishing and {path.name} is missing: see the finding about "
                "the checkpoint moved aside")
    return (f"the first save to {path.name} never finished: there is no complete checkpoint at {path}. Find why "
            "that save failed, re-save, and remove the leftover (wb.clean_incomplete)")


def _siblings(path: Path) -> list[Finding]:
    path = path.absolute()  # "." has no name to look beside
    out = []
    if is_temporary_path(path):
        final = path.with_name(path.name[1 : -len(INCOMPLETE_SUFFIX)])
        if final.exists():
            hint = ("this is an unpublished save (finalize never ran): load the published checkpoint beside it "
                    "instead, and delete this folder (wb.clean_incomplete)")
        else:  # the only copy of that save: deleting it loses what it holds
            hint = (f"this is an unpublished save (finalize never ran) and there is no published checkpoint at "
                    f"{final}: it is the only copy of that save, perhaps incomplete. Find why the save stopped and "
                    "keep this folder until a save there completes (diagnose it against a reference before using it)")
        out.append(Finding("incomplete_checkpoint", "", {"path": str(path)}, hint))
        return out
    pending = temporary_path(path)
    aside = path.with_name(f".{path.name}{OLD_SUFFIX}")
    if pending.exists():
        out.append(Finding("incomplete_checkpoint", "", {"unfinished_save": str(pending)},
                           _unfinished_hint(path, aside.exists())))
    if aside.exists():
        out.append(Finding("incomplete_checkpoint", "", {"moved_aside": str(aside)},
                           "a publish was interrupted between its two renames; the next save repairs it, or "
                           f"move {aside.name} back to {path.name} by hand if {path.name} is missing"))
    return out


def _stray_files(directory: Path, named: set[str], lost: set[str] = frozenset()) -> list[Finding]:
    """A ``.safetensors`` file in an indexed folder that the index does not name: left by another save. An HF loader
    ignores it, except ``model.safetensors``, which transformers reads before the index (a stale single-file save
    beside a sharded one is what a user then loads). One whose header holds keys of ``lost`` (the weight_map lists
    them under a file whose header lacks them) holds this checkpoint's data."""
    out = []
    for file in sorted(p.name for p in directory.glob("*.safetensors") if p.name not in named):
        held = sorted(lost & set(_safe_header(directory / file)[0])) if lost else []
        if held:
            out.append(Finding("index_inconsistent", file, {"file": file, "detail": f"not named by {INDEX_NAME}, "
                               f"yet it holds {len(held)} key(s) the weight_map lists under a file whose header "
                               f"lacks them, e.g. {held[0]!r}"},
                               "it holds this checkpoint's keys that the index points elsewhere: keep it, and point "
                               "those weight_map entries at it (or rebuild the index from the files' headers)"))
        elif not named:  # the index is empty or does not parse: these files are the data, the index is what broke
            out.append(Finding("index_inconsistent", file, {"file": file, "detail": f"not named by {INDEX_NAME}, "
                               "which names no file (it is empty or does not parse)"},
                               "most likely this checkpoint's data, which the broken index does not list: keep it, "
                               "and rebuild the index from the files' headers (or re-save)"))
        elif file == "model.safetensors":
            out.append(Finding("index_inconsistent", file, {"file": file, "detail": f"beside {INDEX_NAME}, which "
                               "does not name it"},
                               "two checkpoints in one folder: transformers loads model.safetensors before the "
                               "index, so it reads this file, not the sharded save; delete the one you do not want"))
        else:
            out.append(Finding("index_inconsistent", file, {"file": file, "detail": f"not named by {INDEX_NAME}"},
                               "a file the index does not name (left by another save?): loaders ignore it; delete "
                               "it, or rebuild the index if it belongs to this save"))
    return out


def _index_files(index_file: Path) -> set[str] | None:
    weight_map, _, problems = read_index(index_file)
    if not weight_map and problems:
        return None  # scan_checkpoint words this problem
    return set(weight_map.values())


def _safe_header(path: Path) -> tuple[dict[str, KeyInfo], dict[str, str], list[str]]:
    """``read_header``, with any parser crash on a hostile header worded as a corrupt header."""
    try:
        return read_header(path)
    except Exception as exc:  # workbench.io's parser assumes some JSON types; a crash means a corrupt header
        return {}, {}, [f"{path}: corrupt header: it does not parse as safetensors ({type(exc).__name__}: {exc})"]


def _scan_without(directory: Path, index_file: Path | None, bad: set[str], findings: list[Finding],
                  lone: Path | None = None) -> CheckpointIndex:
    """Parse the weight-map entries whose file stays in the folder (the others are findings already), one
    header at a time, each parser failure a finding; ``lone`` is a single file without index."""
    if index_file is not None:
        parsed, _, problems = read_index(index_file)
        findings.extend(_classify(p, directory) for p in problems)
        weight_map = {k: v for k, v in parsed.items() if v not in bad}
    else:
        assert lone is not None
        header, _, _ = _safe_header(lone)
        weight_map = dict.fromkeys(header, lone.name)
        if not weight_map:
            _, _, problems = _safe_header(lone)
            findings.extend(_classify(p, directory) for p in problems)
            return CheckpointIndex(directory=directory, weight_map={}, total_size=None, files=(lone.name,), keys={})
    keys: dict[str, KeyInfo] = {}
    metadata: dict[str, dict[str, str]] = {}
    for file in sorted(set(weight_map.values())):
        if not (directory / file).is_file():
            findings.append(_classify(f"{directory / file}: missing file: named by the weight_map", directory))
            continue
        header, meta, problems = _safe_header(directory / file)
        findings.extend(_classify(p, directory) for p in problems)
        metadata[file] = meta
        for key, f in weight_map.items():
            if f == file and key in header:
                keys[key] = header[key]
    return CheckpointIndex(directory=directory, weight_map=weight_map, total_size=None,
                           files=tuple(sorted(set(weight_map.values()))), keys=keys, file_metadata=metadata,
                           index_file=index_file)


def scan_for_findings(path: Path | str) -> ScanResult:
    """Parse ``path`` (an HF folder, a folder with ``model.safetensors``, or one ``.safetensors`` file)
    and word every problem as a Finding; never raises for a damaged checkpoint.

    ``error`` is set when nothing could be read (no such path, not a checkpoint, a folder that may not be
    searched); the findings still name unfinished saves found beside it.
    """
    path = Path(path)
    try:
        return _scan(path)
    except OSError as exc:  # EACCES on a stat (a folder without search permission), EIO: nothing here can be read
        return ScanResult(None, (), f"{path}: cannot read: {exc}")


def _scan(path: Path) -> ScanResult:
    """``scan_for_findings`` of ``path``, an OSError of the file system left to the caller."""
    findings = _siblings(path)
    index_file = path / INDEX_NAME if path.is_dir() else (path if path.name == INDEX_NAME else None)
    if index_file is not None and index_file.is_file():
        directory = index_file.parent
        files = _index_files(index_file)
        bad = set(_escaping(directory, files)) if files is not None else set()
        if bad:
            for name in sorted(bad):
                if _is_link_out(directory, name):
                    findings.append(_link_out(directory, name))
                    continue
                findings.append(Finding("index_inconsistent", name, {"file": name, "detail": "the weight_map names "
                                "a file outside the checkpoint folder; it was not opened"},
                                "a checkpoint must only name files in its own folder: this index was edited or "
                                "crafted; rebuild it from the files' headers"))
            try:
                index = _scan_without(directory, index_file, bad, findings)
            except (OSError, ValueError):
                return ScanResult(None, tuple(findings), f"{index_file}: unreadable index")
            findings.extend(_stray_files(directory, files or set(), set(index.weight_map) - set(index.keys)))
            return ScanResult(index, tuple(findings))
    elif path.is_file() and path.suffix == ".safetensors" and _escaping(path.parent, {path.name}):
        return ScanResult(None, tuple(findings), f"{path}: a link to a file outside its folder; not opened: diagnose "
                          "the file it links to, or a copy with the link resolved (cp -L)")
    try:
        index, problems = scan_checkpoint(path)
    except Exception:  # a hostile header or index that workbench.io's parser does not survive: go file by file
        return _fallback(path, findings)
    unreadable = [p for p in problems if any(u in p for u in _UNREADABLE)]
    if index is not None and index.keys and index.index_file is not None:  # some file read: the rest are findings
        unreadable = [p for p in unreadable if "cannot read" not in p or index.index_file.name in p.partition(": ")[0]]
    if index is None or unreadable:
        error = "; ".join(unreadable or problems) or f"{path}: not a checkpoint"
        return ScanResult(index, tuple(findings), error)
    index, moved = _moved_keys(index, problems)
    problems = [p for p in problems if _classify(p, index.directory).key not in moved]
    findings.extend(_classify(p, index.directory) for p in problems)
    findings.extend(_moved_finding(key, named, file) for key, (named, file) in moved.items())
    if index.index_file is not None:
        findings.extend(_stray_files(index.directory, set(index.weight_map.values()),
                                     set(index.weight_map) - set(index.keys)))
    for file, extra in index.unlisted_keys.items():
        for key in extra:
            named = index.weight_map.get(key)
            if named is not None and named != file and key in index.keys:  # saved twice: the map names the other
                findings.append(Finding("index_inconsistent", key, {
                    "file": file, "detail": f"a duplicate: the key is in this file's header and in {named}'s, and the "
                    f"weight_map names {named}, so HF loaders read that copy and ignore this one"},
                    "the key was saved twice: keep the copy that is right (compare them, or diff against a reference) "
                    "and delete the other, pointing the weight_map at the one kept; do not rebuild the index from "
                    "the headers, which name both"))
                continue
            findings.append(Finding("index_inconsistent", key, {"file": file, "detail": "in the file's header but "
                            "not in the weight_map, so HF loaders ignore it"},
                            "the index is stale: rebuild it from the headers, or re-save"))
    if not problems and index.total_size is not None and index.total_size != index.data_bytes:
        findings.append(Finding("index_inconsistent", INDEX_NAME,
                                {"total_size": index.total_size, "header_bytes": index.data_bytes},
                                "metadata.total_size disagrees with the headers: the index was edited or comes "
                                "from another save; rebuild it"))
    return ScanResult(index, tuple(findings))


def _moved_keys(index: CheckpointIndex, problems: Sequence[str]) -> tuple[CheckpointIndex, dict[str, tuple[str, str]]]:
    """Keys the weight_map maps to a file whose header lacks them, found whole in one other file of the checkpoint
    (which the map does not name for them): ``(the index with those keys read from where they are, {key: (named
    file, file that holds it)})``."""
    lost = {key for p in problems if (key := _listed_not_in_header(p)) is not None}
    holders: dict[str, list[str]] = {}
    for file, extra in index.unlisted_keys.items():
        for key in extra:
            if key in lost and key not in index.keys:
                holders.setdefault(key, []).append(file)
    moved: dict[str, tuple[str, str]] = {}
    found: dict[str, KeyInfo] = {}
    headers: dict[str, tuple[dict[str, KeyInfo], list[str]]] = {}
    for key, files in holders.items():
        if len(files) != 1:
            continue
        if files[0] not in headers:
            header, _, bad = read_header(index.path_of(files[0]))
            headers[files[0]] = header, bad
        header, bad = headers[files[0]]
        if key in header and not bad:
            moved[key] = (index.weight_map[key], files[0])
            found[key] = header[key]
    if not moved:
        return index, {}
    unlisted = {f: tuple(k for k in keys if k not in moved) for f, keys in index.unlisted_keys.items()}
    return replace(index, weight_map={**index.weight_map, **{k: f for k, (_, f) in moved.items()}},
                   keys={**index.keys, **found}, unlisted_keys={f: keys for f, keys in unlisted.items() if keys}), moved


def _listed_not_in_header(problem: str) -> str | None:
    """The key of a "listed in the weight_map but not in this file's header" problem, else None."""
    _, _, detail = problem.partition(": ")
    named = key_named_in(detail)
    return named if "is listed in the weight_map" in detail and "not in this file's header" in detail else None


def _moved_finding(key: str, named: str, holder: str) -> Finding:
    return Finding("index_inconsistent", key, {"file": named, "found_in": holder, "detail": f"the weight_map maps "
                   f"the key to {named}, whose header lacks it; it is whole in {holder}, which the weight_map does not "
                   "name for it (its values are compared from there)"},
                   f"the index maps {key} to {named} but it is in {holder}: fix that one weight_map entry (HF "
                   "loaders fail on it until then); the rest of the index agrees with the files")


def _fallback(path: Path, findings: list[Finding]) -> ScanResult:
    try:
        if path.is_dir() and (path / INDEX_NAME).is_file():
            return ScanResult(_scan_without(path, path / INDEX_NAME, set(), findings), tuple(findings))
        lone = path if path.is_file() else path / "model.safetensors"
        return ScanResult(_scan_without(lone.parent, None, set(), findings, lone=lone), tuple(findings))
    except Exception as exc:
        return ScanResult(None, tuple(findings), f"{path}: unreadable: {type(exc).__name__}: {exc}")
