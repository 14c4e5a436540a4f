"""What makes a checkpoint complete: the test every reader of a published name applies (``validate_final``).

A published checkpoint is a directory under its final name (never a ``.NAME.incomplete`` temporary) with an
index, every file of its weight map present with a readable header listing its keys, and tensor bytes that add
up to the index's ``metadata.total_size``. Both the publisher (which checks what it is about to publish) and the
scanner of a root for its latest checkpoint (``ownership.latest_checkpoint``) use this module.
"""

from __future__ import annotations

from pathlib import Path

from workbench.io.files.index import INDEX_NAME, scan_checkpoint
from workbench.io.files.publish_types import INCOMPLETE_SUFFIX, is_temporary_path, temporary_path

__all__ = ["OLD_SUFFIX", "content_problems", "is_complete", "validate_final"]

OLD_SUFFIX = ".old"  # a previous checkpoint moved aside during a publish: ``.NAME.old``


def content_problems(path: Path) -> list[str]:
    """What is wrong with the checkpoint files in directory ``path``, whatever its name: a missing index, missing
    or truncated files and headers, a total size that disagrees ([] when nothing is)."""
    if not (path / INDEX_NAME).is_file():
        return [f"{path}: no {INDEX_NAME}: every workbench checkpoint has one, so this save never completed"]
    index, problems = scan_checkpoint(path)
    found = list(problems)
    if index is None:
        return found
    if index.total_size is None:
        found.append(f"{index.index_file}: no metadata.total_size (not written by workbench, or edited)")
    elif not found and index.data_bytes != index.total_size:
        found.append(
            f"{index.index_file}: size mismatch: metadata.total_size is {index.total_size} bytes but the "
            f"{len(index.keys)} keys of the weight_map hold {index.data_bytes} bytes"
        )
    return found


def validate_final(path: Path | str) -> list[str]:
    """Every problem that keeps ``path`` from being a complete, published checkpoint ([] when complete).

    Checks: the path is not a temporary (``.NAME.incomplete``) and exists; it has an index; every file of
    the weight map exists and has a readable, untruncated header listing its keys; the tensor bytes
    match ``metadata.total_size``.
    """
    path = Path(path)
    if is_temporary_path(path):
        return [f"{path}: an unpublished save (a '{INCOMPLETE_SUFFIX}' directory): finalize() never ran on it"]
    if not path.exists():
        hints = [
            f"an unfinished save is at {temporary_path(path)}" if temporary_path(path).exists() else "",
            f"a previous checkpoint was moved aside to {path.with_name(f'.{path.name}{OLD_SUFFIX}')} by an "
            "interrupted publish"
            if path.with_name(f".{path.name}{OLD_SUFFIX}").exists()
            else "",
        ]
        hint = "; ".join(h for h in hints if h)
        return [f"{path}: does not exist" + (f" ({hint})" if hint else "")]
    if not path.is_dir():
        return [f"{path}: not a directory; a published checkpoint is a directory with {INDEX_NAME}"]
    return content_problems(path)


def is_complete(path: Path | str) -> bool:
    """True when ``path`` is a published checkpoint with nothing wrong (``validate_final`` finds nothing)."""
    return not validate_final(path)
