"""``replica_readers`` balances the reads of replicated parameters by the bytes of the tensors they fill: a layout
built from LoadSpecs gives no dtypes, and counting every parameter as float32 handed the reads out unevenly."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

import workbench as wb
from workbench.io.files.staging import SLOT_BYTES
from workbench.io.hf.load import replica_readers

MESH = wb.MeshSpec((2,), ("dp",))


def test_reads_are_balanced_by_the_targets_bytes() -> None:
    sizes = {"a": 100, "b": 60, "c": 60}
    specs = {n: wb.LoadSpec.from_placements(n, [n], (k,), MESH, [Replicate()]) for n, k in sizes.items()}
    layout = wb.Layout(MESH, specs)  # no dtypes given
    targets = {"a": torch.empty(100, dtype=torch.bfloat16), "b": torch.empty(60), "c": torch.empty(60)}
    # by hand, in model order, the least-loaded member reads: a (200 B) -> 0; b (240 B) -> 1 (0 has 200);
    # c (240 B) -> 0 (200 < 240). Counting a as float32 (400 B) gave c to member 1: 200 B against 480 B
    for rank in (0, 1):
        readers = replica_readers(layout, specs, rank, targets)
        assert {n: r.reader for n, r in readers.items()} == {"a": 0, "b": 1, "c": 0}
        assert {n for n, r in readers.items() if r.reads} == ({"a", "c"} if rank == 0 else {"b"})
        assert {r.mesh_dim for r in readers.values()} == {"dp"}


def test_each_key_read_counts_as_two_mib_of_work() -> None:
    """One 4 MiB parameter against four of 256 KiB: by bytes alone member 1 read all four small ones (1 MiB against
    4 MiB), yet four reads cost its loading thread more than the one. By hand, with 2 MiB a key: big -> 0 (6 MiB);
    s0 -> 1 (2.25); s1 -> 1 (4.5); s2 -> 1 (6.75, as 4.5 < 6); s3 -> 0 (6 < 6.75)."""
    numels = {"big": 1 << 20, "s0": 1 << 16, "s1": 1 << 16, "s2": 1 << 16, "s3": 1 << 16}  # float32
    specs = {n: wb.LoadSpec.from_placements(n, [n], (k,), MESH, [Replicate()]) for n, k in numels.items()}
    layout = wb.Layout(MESH, specs)
    targets = {n: torch.empty(k) for n, k in numels.items()}
    readers = replica_readers(layout, specs, 0, targets)
    assert {n: r.reader for n, r in readers.items()} == {"big": 0, "s0": 1, "s1": 1, "s2": 1, "s3": 0}


def test_a_fused_parameter_counts_a_read_a_staging_slot_not_a_read_a_key() -> None:
    """128 experts of 512 KiB fused in one 64 MiB parameter are read as two slot-sized pieces (32 MiB slots), not
    128 reads: its work is 64 + 2 x 2 = 68 MiB (128 reads would make it 320). By hand: fused -> 0 (68 MiB); then
    fifteen 3 MiB norms (5 MiB of work each) -> 1 for the first fourteen (70 MiB after the fourteenth, as 65 < 68),
    and the fifteenth -> 0 (68 < 70)."""
    assert SLOT_BYTES == (32 << 20) + 2 * 4096  # the hand count above assumes it
    fused_keys = [f"e{i}" for i in range(128)]
    specs = {"fused": wb.LoadSpec.from_placements("fused", fused_keys, (128 * 131072,), MESH, [Replicate()],
                                                fused_dim=0)}
    norms = [f"n{i}" for i in range(15)]
    specs.update({n: wb.LoadSpec.from_placements(n, [n], (3 << 18,), MESH, [Replicate()]) for n in norms})
    layout = wb.Layout(MESH, specs)
    targets = {"fused": torch.empty(128 * 131072), **{n: torch.empty(3 << 18) for n in norms}}
    readers = replica_readers(layout, specs, 0, targets)
    assert {n: r.reader for n, r in readers.items()} == {"fused": 0, **{n: 1 for n in norms[:14]}, "n14": 0}
