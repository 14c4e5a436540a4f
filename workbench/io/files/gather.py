"""Short runs of a file read packed, in one native call per box that holds no GIL.

A rank that owns half of each row of a matrix (expert tensor parallelism's ``down_proj``) owns runs shorter than a
page, so the page cache gives it whole pages either way. Read as their span, every byte of the span is copied out of
the page cache into the staging slot and on to the GPU: twice the rank's bytes. ``gather_runs`` reads the runs
packed into the slot with ``preadv``, each gap between two runs going into a small scratch buffer of the calling
thread that stays in its core's cache: the slot, the memory bus and the copy to the GPU carry only owned bytes.

It is a few lines of C, compiled on first use with the machine's C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/workbench/native`` (a directory of this user's, mode 0700) and loaded with ``ctypes``. One call
reads a whole box: its ``preadv`` calls (one per 511 runs, ``IOV_MAX`` buffers) run without the GIL. Called once per
batch from Python instead, sixteen reading threads gave up and took back the GIL 128 times per box, and a warm
expert-TP load ran three times slower than reading the spans (sixteenth session, ``bench/RESULTS.md``).

Where no compiler is found, the build fails, or ``WORKBENCH_NATIVE=0``, ``native_gather()`` is None and says why
(``why_not_native``): boxes are read as their spans, as before.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["NATIVE_ENV", "gather_runs", "native_gather", "why_not_native"]

NATIVE_ENV = "WORKBENCH_NATIVE"  # "0": never build or load native code (boxes of short runs are read as spans)
MAX_DIMS = 16  # dims outside the runs a gather takes (a box has at most a tensor's dims)
SCRATCH_BYTES = 64 << 10  # a reading thread's sink for the bytes between runs; a wider gap ends a preadv

_SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/uio.h>
#include <unistd.h>

#define WB_IOV 1024
#define WB_SCRATCH 65536
#define WB_MAX_DIMS 16

static __thread char scratch[WB_SCRATCH];

/* Read the runs of `run` bytes at `offset + sum(i[d] * steps[d])`, for every index i of `sizes` in row-major
   order, packed into `dest` (which holds `dest_bytes`). Returns the bytes asked of the file (runs and the gaps
   read between them), or -errno: -EINVAL for runs that overlap or go backwards, or a dest too small; -EIO for a
   file that ends before the last run. */
int64_t wb_gather(int fd, int64_t offset, int64_t run, int ndim, const int64_t *sizes, const int64_t *steps,
                  char *dest, int64_t dest_bytes) {
    int64_t index[WB_MAX_DIMS] = {0};
    int64_t total = 1, asked = 0, done = 0, pos = offset;
    struct iovec iov[WB_IOV];
    if (ndim < 0 || ndim > WB_MAX_DIMS || run <= 0) return -EINVAL;
    for (int d = 0; d < ndim; d++) total *= sizes[d];
    if (total == 0) return 0;
    if (total > dest_bytes / run) return -EINVAL;
    while (done < total) {
        int k = 0;
        int64_t start = pos, want = 0;
        for (;;) {
            iov[k].iov_base = dest + done * run;
            iov[k].iov_len = (size_t)run;
            k++;
            want += run;
            int64_t here = pos;
            done++;
            if (done == total) break;
            int d = ndim - 1; /* the next index, row-major: the last dim fastest */
            while (d >= 0 && ++index[d] == sizes[d]) {
                pos -= (sizes[d] - 1) * steps[d];
                index[d] = 0;
                d--;
            }
            pos += steps[d];
            int64_t gap = pos - here - run;
            if (gap < 0) return -EINVAL;
            if (gap > WB_SCRATCH || k + 2 > WB_IOV) break;
            if (gap > 0) {
                iov[k].iov_base = scratch;
                iov[k].iov_len = (size_t)gap;
                k++;
                want += gap;
            }
        }
        struct iovec *v = iov;
        int count = k;
        int64_t got_all = 0;
        while (got_all < want) {
            ssize_t got = preadv(fd, v, count, start + got_all);
            if (got < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (got == 0) return -EIO;
            got_all += got;
            while (count > 0 && (size_t)got >= v->iov_len) { /* a short read: go on where it stopped */
                got -= (ssize_t)v->iov_len;
                v++;
                count--;
            }
            if (count > 0) {
                v->iov_base = (char *)v->iov_base + got;
                v->iov_len -= (size_t)got;
            }
        }
        asked += want;
    }
    return asked;
}
"""

_LOCK = threading.Lock()
_LOADED: list[tuple[Callable[..., int] | None, str]] = []  # (the function, or None and why), once per process


def native_gather() -> Callable[..., int] | None:
    """The compiled ``wb_gather`` (built and loaded once per process), or None where it cannot be had."""
    return _load()[0]


def why_not_native() -> str:
    """Why ``native_gather()`` is None ("" when it is not)."""
    return _load()[1]


def gather_runs(fd: int, offset: int, run: int, sizes: Sequence[int], steps: Sequence[int], dest: int,
                dest_bytes: int) -> int:
    """Read the runs of ``run`` bytes at ``offset + sum(i[d] * steps[d])`` (for every index ``i`` of ``sizes``, in
    file order) from ``fd`` into the memory at address ``dest`` (``dest_bytes`` long), packed one after the other.
    Returns the bytes asked of the file: the runs and the gaps read between them.

    Raises:
        OSError: no native gather here (``ENOSYS``, naming why), a read failed, or the file ended before the last
            run (``EIO``: truncated?).
        ValueError: the runs overlap or go backwards, or ``dest_bytes`` cannot hold them.
    """
    fn = native_gather()
    if fn is None:
        raise OSError(errno.ENOSYS, f"no native gather: {why_not_native()}")
    if len(sizes) != len(steps) or len(sizes) > MAX_DIMS:
        raise ValueError(f"gather_runs: sizes {tuple(sizes)} and steps {tuple(steps)} must pair, at most {MAX_DIMS}")
    dims = len(sizes)
    got = fn(fd, offset, run, dims, (ctypes.c_int64 * dims)(*sizes), (ctypes.c_int64 * dims)(*steps), dest,
             dest_bytes)
    if got == -errno.EINVAL:
        raise ValueError(f"gather_runs: {run}-byte runs of sizes {tuple(sizes)}, steps {tuple(steps)} overlap, go "
                         f"backwards or do not fit {dest_bytes} bytes")
    if got == -errno.EIO:
        raise OSError(errno.EIO, f"the file ends before the last {run}-byte run from byte {offset} (truncated?)")
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return got


def _load() -> tuple[Callable[..., int] | None, str]:
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_build_and_load())
        return _LOADED[0]


def _build_and_load() -> tuple[Callable[..., int] | None, str]:
    if os.environ.get(NATIVE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, f"{NATIVE_ENV}={os.environ[NATIVE_ENV]}"
    if platform.system() != "Linux":
        return None, f"preadv and the build are Linux's; this is {platform.system()}"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler!r} is not on PATH; set CC)"
    digest = hashlib.sha256(f"{_SOURCE}\0{compiler}\0{platform.machine()}".encode()).hexdigest()[:16]
    try:
        folder = _cache_folder()
        library = folder / f"gather-{digest}.so"
        if not library.is_file():
            _compile(compiler, folder, library)
        lib = ctypes.CDLL(str(library))  # a CDLL call releases the GIL
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building the native gather failed: {exc}"
    fn = lib.wb_gather
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                   ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_int64]
    return fn, ""


def _cache_folder() -> Path:
    """This user's folder for built libraries: created with mode 0700; refused when another user owns it or others
    may write it (a library loaded from there runs as this process)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = root / "workbench" / "native"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"{folder} is not this user's alone (owner {st.st_uid}, mode "
                                   f"{st.st_mode & 0o777:o})")
    return folder


def _compile(compiler: str, folder: Path, library: Path) -> None:
    """Build the library into ``folder`` and move it to ``library`` in one rename (ranks building at once each
    move a whole library there)."""
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        source = Path(scratch) / "gather.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / "gather.so"
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(errno.ENOEXEC, f"{compiler} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(built, library)
