"""File plan: which safetensors file each HF key goes to, named and numbered the HF way.

Every rank computes the same plan from the same inputs (writer assignment, key sizes, key order), so
no file names travel over the network. Files are numbered globally, writer by writer:

======  ======================  ==========================================================
writer  keys (bytes), max 10    files
======  ======================  ==========================================================
0       a (6), b (3), c (4)     model-00001-of-00004: a, b     model-00002-of-00004: c
1       d (12), e (1)           model-00003-of-00004: d (alone: over the cap)     model-00004-of-00004: e
======  ======================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from workbench.errors import CheckpointError
from workbench.units import head_and_tail

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "FilePlan", "FileSpec", "file_name", "plan_files"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def file_name(prefix: str, number: int, total: int) -> str:
    """The HF shard name: ``file_name("model", 1, 3) == "model-00001-of-00003.safetensors"``."""
    return f"{prefix}-{number:05d}-of-{total:05d}.safetensors"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True, slots=True)
class FileSpec:
    """One safetensors file: its name, the rank that writes it, its keys in order, and their tensor bytes.

    ``nbytes`` counts tensor data only (the header adds a few kB on disk).
    """

    name: str
    writer: int
    keys: tuple[str, ...]
    nbytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if self.nbytes < 0 or self.writer < 0:
            raise CheckpointError(f"FileSpec {self.name!r} needs writer >= 0 and nbytes >= 0, got {self}")

    def __str__(self) -> str:
        return f"{self.name}  rank {self.writer}  {len(self.keys)} key(s)  {_fmt_bytes(self.nbytes)}"


@dataclass(frozen=True, slots=True)
class FilePlan:
    """Every file of a checkpoint, the HF ``weight_map`` (key -> file name) and ``total_size`` (bytes)."""

    files: tuple[FileSpec, ...]
    weight_map: dict[str, str]
    total_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files))
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise CheckpointError(f"FilePlan lists a file name twice: {sorted(n for n in names if names.count(n) > 1)}")
        stray = {k: v for k, v in self.weight_map.items() if v not in set(names)}
        if stray:
            raise CheckpointError(
                f"FilePlan weight_map names files that are not in the plan: {dict(list(stray.items())[:3])}"
            )

    def files_of(self, rank: int) -> tuple[FileSpec, ...]:
        """The files ``rank`` writes, in file order (empty for a rank that writes nothing)."""
        return tuple(f for f in self.files if f.writer == rank)

    @property
    def writers(self) -> tuple[int, ...]:
        """The ranks that write at least one file, ascending."""
        return tuple(sorted({f.writer for f in self.files}))

    def __str__(self) -> str:
        lines = [
            f"FilePlan: {len(self.files)} file(s), {len(self.weight_map)} key(s), "
            f"{_fmt_bytes(self.total_size)}, {len(self.writers)} writer(s)"
        ]
        lines += head_and_tail(self.files, "files")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"FilePlan(files={len(self.files)}, keys={len(self.weight_map)}, total_size={self.total_size})"


def plan_files(
    writers: Mapping[str, int],
    key_bytes: Mapping[str, int],
    key_order: Sequence[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    prefix: str = "model",
) -> FilePlan:
    """Pack each writer's keys into files of at most ``max_shard_bytes`` and name them globally.

    For each writer rank in ascending order, its keys (in ``key_order`` order) are packed greedily: a key
    that would overflow the current file starts a new one, and a key larger than ``max_shard_bytes`` gets a
    file alone. Files are numbered 1..N in (writer, pack) order and named
    ``{prefix}-{k:05d}-of-{N:05d}.safetensors``; a one-file checkpoint is ``model-00001-of-00001``.

    Args:
        writers: ``{hf_key: writer rank}`` (e.g. from ``workbench.plan.writers.assign_writers``).
        key_bytes: tensor bytes of every key at its save dtype.
        key_order: every key of ``writers`` exactly once, in the order the files should list them.
        max_shard_bytes: the size cap of one file (tensor bytes), HF's default 5 GB.
        prefix: file name prefix.

    Returns:
        The same ``FilePlan`` on every rank that passes the same arguments.

    Raises:
        CheckpointError: a key without a size or without a writer, keys of ``writers`` missing from
            ``key_order`` or listed twice, a negative size, ``max_shard_bytes <= 0``, or a bad prefix.
    """
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not prefix or "/" in prefix or prefix.startswith("."):
        raise CheckpointError(f"file prefix must be a plain, non-hidden file name part such as 'model', got {prefix!r}")
    no_size = [k for k in writers if k not in key_bytes]
    if no_size:
        raise CheckpointError(
            f"{len(no_size)} key(s) have a writer but no size in key_bytes, e.g. {no_size[:3]}; "
            "pass the byte size of every key that is written"
        )
    negative = [k for k in writers if key_bytes[k] < 0]
    if negative:
        raise CheckpointError(f"key_bytes must be >= 0, got {negative[0]!r}: {key_bytes[negative[0]]}")
    seen: set[str] = set()
    for key in key_order:
        if key not in writers:
            raise CheckpointError(
                f"key {key!r} is in key_order but has no writer rank; assign it a writer or drop it from key_order"
            )
        if key in seen:
            raise CheckpointError(f"key {key!r} appears twice in key_order")
        seen.add(key)
    unordered = [k for k in writers if k not in seen]
    if unordered:
        raise CheckpointError(
            f"{len(unordered)} key(s) have a writer but are missing from key_order, e.g. {sorted(unordered)[:3]}; "
            "key_order must list every written key once"
        )

    by_writer: dict[int, list[str]] = {}
    for key in key_order:
        by_writer.setdefault(int(writers[key]), []).append(key)
    packs: list[tuple[int, list[str], int]] = []  # (writer, keys, bytes)
    for rank in sorted(by_writer):
        current: list[str] = []
        current_bytes = 0
        for key in by_writer[rank]:
            size = int(key_bytes[key])
            if current and current_bytes + size > max_shard_bytes:
                packs.append((rank, current, current_bytes))
                current, current_bytes = [], 0
            current.append(key)
            current_bytes += size
        if current:
            packs.append((rank, current, current_bytes))

    total = len(packs)
    files = tuple(
        FileSpec(name=file_name(prefix, number, total), writer=rank, keys=tuple(keys), nbytes=nbytes)
        for number, (rank, keys, nbytes) in enumerate(packs, start=1)
    )
    weight_map = {key: spec.name for spec in files for key in spec.keys}
    return FilePlan(files=files, weight_map=weight_map, total_size=sum(spec.nbytes for spec in files))
