"""What a load reads from the disk, counted by the OS, not by the loader.

``LoadReport.bytes_read`` sums the slices ``load_hf`` asked the files for, so it cannot show read amplification
(readahead, whole-tensor reads, a reader that maps and touches too much). Here each of 2 gloo ranks loads its
half of two of a checkpoint's three tensors, the file's pages evicted first, and counts what its process made the
kernel fetch from storage (``/proc/self/io`` ``read_bytes``). The sum over the ranks must stay within a few percent
of the bytes they own, through the page cache (``WORKBENCH_READ_DIRECT=0``) and with O_DIRECT (``auto`` on a cold
cache, where each rank's owned box is read as its range rounded out to 4 KiB: at most 8 KiB more per request).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb

ROWS, COLS = 2048, 1024  # two float32 tensors of 8 MiB: far above any readahead window
KEYS = ("model.a.weight", "model.b.weight")  # loaded; the file also holds model.c.weight, which nobody owns


def _os_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise OSError("no read_bytes in /proc/self/io")


def _evict(folder: Path) -> None:
    os.sync()
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load_half(root: str, direct: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    target = {k: DTensor.from_local(torch.zeros(ROWS // 2, COLS), mesh, [Shard(0)]) for k in KEYS}
    if dist.get_rank() == 0:
        _evict(Path(root))
    dist.barrier()
    os.environ["WORKBENCH_READ_DIRECT"] = direct
    before = _os_read_bytes()
    report = wb.load_hf(target, root, strict=False, timeout=30)
    read = _os_read_bytes() - before
    rank = dist.get_rank()
    rows = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    expected = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)[rows]
    exact = all(torch.equal(t.to_local(), expected + i) for i, t in enumerate(target.values()))
    dist.barrier()  # both ranks' reads are done before anyone asks the page cache
    middle = rows.start * COLS * 4 + ROWS * COLS * 2  # a byte in the middle of this rank's rows of model.a.weight
    return {"os_read": read, "owned": report.bytes_owned, "exact": exact,
            "cached": _cached(Path(root) / "model.safetensors", middle)}


def _cached(path: Path, data_offset: int) -> bool | None:
    """Whether the page holding ``data_offset`` of the data section is in the page cache (a non-blocking read),
    None where the kernel cannot tell."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        os.preadv(fd, [bytearray(1)], start + data_offset, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    except (OSError, AttributeError):
        return None
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", ["0", "auto"])
def test_a_cold_load_reads_from_disk_only_what_the_ranks_own(tmp_path: Path, direct: str) -> None:
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    save_file({k: full + i for i, k in enumerate((*KEYS, "model.c.weight"))}, str(tmp_path / "model.safetensors"))
    probe = tmp_path / "model.safetensors"
    _evict(tmp_path)
    before = _os_read_bytes()
    with open(probe, "rb") as f:
        f.read(1 << 20)
    if _os_read_bytes() - before < (1 << 20):  # a filesystem or container that does not count block reads
        pytest.skip("/proc/self/io read_bytes does not count reads of evicted pages here")
    results = wb.launch(_load_half, nprocs=2, backend="gloo", args=(str(tmp_path), direct), timeout=120)
    assert all(r["exact"] for r in results.values())
    owned = sum(r["owned"] for r in results.values())
    assert owned == 2 * ROWS * COLS * 4
    read = sum(r["os_read"] for r in results.values())
    # the header (a few hundred bytes) is read too, and the kernel reads whole pages: allow 2% and 1 MiB
    assert read <= 1.02 * owned + (1 << 20), f"the disk read {read} bytes for {owned} owned ({read / owned:.3f}x)"
    assert read >= 0.9 * owned, f"the disk read {read} bytes for {owned} owned: were the pages evicted?"
    if direct == "auto":  # cold and 4 MiB a request: O_DIRECT, so the owned pages stayed out of the page cache
        assert [r["cached"] for r in results.values()] in ([False, False], [None, None])
        # 4 requests (2 ranks x 2 keys whose boxes do not touch), each's aligned cover at most 2 pages more; the
        # header a page or two, read by each rank
        assert read <= owned + 4 * 2 * 4096 + 2 * 3 * 4096, f"{read - owned} bytes read beyond the {owned} owned"
    else:
        assert [r["cached"] for r in results.values()] in ([True, True], [None, None])
