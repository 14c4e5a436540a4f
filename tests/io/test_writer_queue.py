"""WriterQueue's bound on the host memory its queued copies keep alive."""

from __future__ import annotations

import torch

from workbench.io.files.snapshot import HostCopy
from workbench.io.hf.save_timings import SaveClock
from workbench.io.hf.save_writers import WriterQueue


def _caught(exc: BaseException, stage: str):
    raise AssertionError(f"{stage}: {exc!r}")


def test_views_of_one_storage_are_charged_that_storage_once_until_the_last_leaves() -> None:
    fused = torch.zeros(2, 512)  # 4 KiB: two keys of 2 KiB, each a view that keeps all 4 KiB alive
    other = torch.zeros(256)  # 1 KiB
    queue = WriterQueue(0, 1, 4096, SaveClock(), _caught, gated=True)
    written = []
    try:
        for key, value in zip("ab", fused.chunk(2)):
            queue.queue(2048, lambda key=key: written.append(key) or 0, HostCopy(value), key,
                        storage=(fused.untyped_storage().data_ptr(), 4096))
        assert queue.queued_bytes == 4096 and len(queue.pending) == 2 and not written  # within 4 KiB: no wait
        queue.queue(1024, lambda: written.append("c") or 0, HostCopy(other), "c",
                    storage=(other.untyped_storage().data_ptr(), 1024))
        # 4 KiB + 1 KiB is over the bound: the 4 KiB go only once both keys holding them are written
        assert written == ["a", "b"] and len(queue.pending) == 1 and queue.queued_bytes == 1024
        assert queue.drain() is None and written == ["a", "b", "c"] and queue.queued_bytes == 0
    finally:
        queue.close()
