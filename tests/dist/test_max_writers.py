"""``max_writers`` is honored in every write mode (issue 20: with direct writes, 2 ranks and ``max_writers=1``,
both ranks wrote). Which ranks wrote is counted at the file layer: every open of a path under the checkpoint's
folder for writing (``os.open``, ``open``, a memory map's file), seen by a Python audit hook in each rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import workbench as wb
from tests.faults.harness import layout_of, new_values, write_old_checkpoint
from tests.io.support import read_checkpoint

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_OPENED: list[str] = []  # paths this process opened for writing (filled by the audit hook)


def _record_writes(event: str, args: tuple) -> None:
    if event != "open":
        return
    path, mode, flags = args
    if not isinstance(path, str | bytes | os.PathLike):
        return  # an open of a file descriptor
    writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITES)
    if writing:
        _OPENED.append(os.fsdecode(path))


def _saves(root: str) -> dict:
    import torch.distributed as dist

    from tests.faults.harness import _local_state

    sys.addaudithook(_record_writes)
    rank = dist.get_rank()
    layout = layout_of(2)  # embed rows, fused experts (whole keys per rank), proj columns, a replicated norm
    out = {}
    for name, options in {
        "direct-1": {"write_mode": "direct", "max_writers": 1},
        "auto-1": {"write_mode": "auto", "max_writers": 1},
        "gather-1": {"write_mode": "gather", "max_writers": 1},
        "direct-none": {"write_mode": "direct", "max_writers": None},
        "direct-2": {"write_mode": "direct", "max_writers": 2},
    }.items():
        state = _local_state(layout, rank)
        wb.load_hf(state, Path(root) / "old", layout=layout)
        for tensor in state.values():
            tensor.add_(1)
        target = Path(root) / name
        _OPENED.clear()
        result = wb.save_hf(state, target, layout=layout, max_shard_bytes=256, **options)
        # the save writes into .NAME.incomplete, renamed to NAME when published
        mine = sorted({Path(p).name for p in _OPENED if f".{name}.incomplete" in p or p.startswith(str(target))})
        out[name] = {"opened": mine, "mode": result.write_mode, "bytes": result.bytes_written}
    # preserve keeps experts 2-3 on rank 1, which may not write: refused on every rank, before any data moves
    experts = wb.Layout(layout.mesh, {"experts": layout["experts"]}, {"experts": "bfloat16"})
    state = {"experts": _local_state(layout, rank)["experts"]}
    _OPENED.clear()
    try:
        wb.save_hf(state, Path(root) / "preserve-1", layout=experts, policy=wb.SavePolicy.preserve("fsdp"),
                   max_writers=1, timeout=30)
        out["preserve-1"] = None
    except Exception as exc:
        out["preserve-1"] = {"type": type(exc).__name__, "message": str(exc), "opened": list(_OPENED)}
    return out


def test_max_writers_limits_the_ranks_that_open_files_in_every_write_mode(tmp_path: Path) -> None:
    write_old_checkpoint(tmp_path / "old")
    results = wb.launch(_saves, nprocs=2, args=(str(tmp_path),), timeout=240)
    want = new_values()
    for name in ("direct-1", "auto-1", "gather-1", "direct-none", "direct-2"):
        got = read_checkpoint(tmp_path / name)
        assert got.keys() == want.keys(), name
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (name, key)
    for rank in (0, 1):
        refused = results[rank].pop("preserve-1")
        assert refused is not None and refused["type"] == "SaveFailed", refused
        assert "max_writers=1" in refused["message"] and "'model.experts.2.weight'" in refused["message"], refused
        assert not [p for p in refused["opened"] if "preserve-1" in p]
    assert not [p for p in tmp_path.iterdir() if "preserve-1" in p.name]
    writers = {name: {r for r, per in results.items() if per[name]["opened"]} for name in results[0]}
    # one writer allowed: rank 1 opens no file of the checkpoint for writing, in any mode (auto is direct here)
    assert results[0]["auto-1"]["mode"] == "direct" and results[0]["direct-1"]["mode"] == "direct"
    for name in ("direct-1", "auto-1", "gather-1"):
        assert writers[name] == {0}, (name, results[1][name])
        assert results[1][name]["bytes"] == 0, name
    # the count sees rank 1 when it does write: uncapped (or capped at the world) direct saves use both ranks
    assert writers["direct-none"] == {0, 1} and writers["direct-2"] == {0, 1}
    assert any(n.endswith(".safetensors") for n in results[1]["direct-none"]["opened"])
