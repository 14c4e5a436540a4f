"""Streaming: a diff holds a few blocks, not the checkpoints (the 2 GB figure is in bench/debug.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.debug.corpus import write

ROOT = Path(__file__).resolve().parents[2]
_CHILD = r"""
import threading, time
def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
class Peak:
    def __enter__(self):
        self.base = _rss(); self.peak = self.base; self._stop = False
        def run():
            while not self._stop:
                self.peak = max(self.peak, _rss()); time.sleep(0.005)
        self._t = threading.Thread(target=run, daemon=True); self._t.start(); return self
    def __exit__(self, *exc):
        self._stop = True; self._t.join(); self.peak = max(self.peak, _rss())
import sys
from workbench.debug import diff_checkpoints
import workbench.debug.analyze
diff_checkpoints(sys.argv[1], sys.argv[1], block_bytes=1 << 20)  # warm up every code path on a tiny read
with Peak() as p:
    report = diff_checkpoints(sys.argv[2], sys.argv[3], block_bytes=1 << 20)
print([(f.kind, f.transform) for f in report.findings]); print("EXTRA_KIB", (p.peak - p.base) // 1024)
"""


@pytest.mark.slow
def test_diff_memory_stays_within_a_few_blocks(tmp_path) -> None:
    # two 96 MiB checkpoints (3 x 32 MiB fp32 tensors), one tensor with its two row halves swapped; 1 MiB blocks
    g = torch.Generator().manual_seed(0)
    a = {f"w{i}": torch.randn(2048, 4096, generator=g) for i in range(3)}
    b = dict(a) | {"w2": torch.cat(a["w2"].chunk(2)[::-1])}
    write(tmp_path / "a", a)
    write(tmp_path / "b", b)
    del a, b
    write(tmp_path / "tiny", {"x": torch.zeros(4)})
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "tiny"), str(tmp_path / "a"),
                           str(tmp_path / "b")], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "permuted" in done.stdout, done.stdout
    extra_mib = int(done.stdout.split("EXTRA_KIB")[1]) / 1024
    assert extra_mib < 24, f"{extra_mib:.1f} MiB extra for a 2 x 96 MiB diff with 1 MiB blocks: {done.stdout}"
