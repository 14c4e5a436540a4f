"""Page-cache helpers the load and save benchmarks share: evict files before a cold read, fill the cache before a
warm one, say how much of some files is cached, and count what the disk read for this process.

``bench/load.py`` and ``bench/save_load.py`` import this module by name (``bench/`` is the script's directory) and
register it with ``cloudpickle.register_pickle_by_value``, so their rank functions carry these helpers to ranks
started by ``wb.launch`` whatever those ranks' ``sys.path``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from workbench.io.files.box_reads import cached_share

BLOCK = 64 << 20  # fill() reads in blocks of this size, as ``dd bs=64M`` does


def evict(paths: Sequence[Path]) -> None:
    """Write back, then drop these files' pages from the page cache (a cold read follows)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fill(paths: Sequence[Path]) -> None:
    """Read every byte of these files through the page cache (a warm read follows)."""
    buf = bytearray(BLOCK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def cached(paths: Sequence[Path]) -> float:
    """The share of these files' bytes in the page cache, from 32 sampled pages per file (``mincore``), weighted by
    file size; NaN where the kernel cannot tell."""
    total = share = 0.0
    for p in paths:
        size = os.path.getsize(p)
        fd = os.open(p, os.O_RDONLY)
        try:
            got = cached_share(fd, 0, size)
        finally:
            os.close(fd)
        if got is None:
            return float("nan")
        total += size
        share += got * size
    return share / total if total else float("nan")


def os_read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage so far (``/proc/self/io`` ``read_bytes``): what the
    disk really read for it, readahead and O_DIRECT reads included, page-cache hits excluded."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise OSError("/proc/self/io has no read_bytes line")
