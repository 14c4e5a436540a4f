"""Bad input to save_hf / load_hf: each is a clear error that names what is wrong, nothing is written at the target
path, and a checkpoint already there survives byte for byte.

Most cases need one process (plain tensors, or DTensor metadata on a fake process group). One gloo launch of 4
ranks checks that a problem on ONE rank fails EVERY rank with the same error, with no rank left hanging.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench import _compat
from workbench.errors import CheckpointError, LayoutError
from workbench.io.files.index import INDEX_NAME

KEY_MAP = {
    r"embed\.weight": "model.embed_tokens.weight",
    r"layers\.(\d+)\.w": r"model.layers.\1.mlp.weight",
}  # no pattern for "norm.weight"


def _model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 4, generator=gen),
        "layers.0.w": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        "layers.1.w": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.randn(4, generator=gen),
    }


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (recursively), with its bytes; the parent's entries under '..'."""
    files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
    return {**files, "..": "\n".join(sorted(p.name for p in directory.parent.iterdir())).encode()}


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """A complete checkpoint at ``tmp_path/ckpt`` (the one a bad save must not damage)."""
    path = tmp_path / "ckpt"
    wb.save_hf({"old.weight": torch.arange(6.0).reshape(2, 3)}, path)
    assert (path / INDEX_NAME).is_file()
    return path


# -- one process ---------------------------------------------------------------------------------------------------


def test_a_key_map_that_misses_a_parameter_names_it_and_writes_nothing(tmp_path: Path, old: Path) -> None:
    before = _snapshot(old)
    for target in (old, tmp_path / "new"):
        with pytest.raises(LayoutError, match=r"covers no HF key for 1 parameter\(s\): \['norm\.weight'\]"):
            wb.save_hf(_model(), target, key_map=KEY_MAP)
    assert _snapshot(old) == before
    assert not (tmp_path / "new").exists()

    # load_hf with the same key map fails the same way, before touching a tensor
    model = _model()
    untouched = {k: v.clone() for k, v in model.items()}
    with pytest.raises(LayoutError, match=r"norm\.weight"):
        wb.load_hf(model, old, key_map=KEY_MAP)
    assert all(torch.equal(model[k], untouched[k]) for k in model)


def test_a_partial_dtensor_is_refused_naming_the_parameter(tmp_path: Path, old: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    before = _snapshot(old)
    with _compat.fake_process_group(rank=0, world_size=2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        state = {
            "w_sharded": DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False),
            "w_pending": DTensor.from_local(torch.ones(4, 4), mesh, [Partial()], run_check=False),
        }
        for target in (old, tmp_path / "new"):
            with pytest.raises(LayoutError, match=r"parameter 'w_pending'.*Partial") as info:
                wb.save_hf(state, target)
            assert "w_sharded" not in str(info.value)
            assert "Reduce first" in str(info.value)  # and what to do about it
    assert _snapshot(old) == before
    assert not (tmp_path / "new").exists()


def test_a_target_path_that_is_a_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    box = tmp_path / "box"
    box.mkdir()
    target = box / "notes.txt"
    target.write_text("not a checkpoint\n")
    before = _snapshot(box)
    with pytest.raises(CheckpointError, match="nothing was published") as info:
        wb.save_hf(_model(), target)
    message = str(info.value)
    assert str(target) in message and "is a file" in message
    assert target.read_text() == "not a checkpoint\n"
    assert _snapshot(box) == before  # no hidden .notes.txt.incomplete left behind either


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_directory_that_is_not_a_checkpoint_is_refused_and_left_alone(tmp_path: Path, async_save: bool) -> None:
    # ``save_hf(model, "runs")`` meant for ``runs/step-200``: the directory holds a published checkpoint and a user's
    # notes. A save replaces the directory at its path whole, so it used to delete both without a word.
    runs = tmp_path / "runs"
    runs.mkdir()
    wb.save_hf(_model(), runs / "step-100")
    (runs / "notes").mkdir()
    (runs / "notes" / "results.csv").write_text("step,loss\n100,1.5\n")
    plain = tmp_path / "data"
    plain.mkdir()
    (plain / "train.jsonl").write_text("{}\n")
    for target, why in ((runs, "it holds directories, which a save would delete: notes/, step-100/"),
                        (plain, f"no {INDEX_NAME}, no model*.safetensors file and no config.json, but train.jsonl")):
        before = _snapshot(target)
        with pytest.raises(CheckpointError, match="nothing was published") as info:
            handle = wb.save_hf(_model(), target, async_save=async_save)
            if async_save:
                handle.wait()
        message = str(info.value)
        assert str(target) in message and why in message and "not a checkpoint" in message, message
        assert _snapshot(target) == before  # every file kept, no hidden .NAME.incomplete left beside it
    assert wb.latest_checkpoint(runs).path == runs / "step-100"
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (runs / "step-100", empty):  # a checkpoint is replaced, an empty directory filled
        result = wb.save_hf(_model(), target, async_save=async_save)
        if async_save:
            result.wait()
        assert (target / INDEX_NAME).is_file()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing config file", r"config file\(s\) to copy do not exist: \['.*no-such-config\.json'\]"),
        ("missing parent directory", r"parent directory .*no-such-dir does not exist"),
        ("gather_only policy", r"SavePolicy\.gather_only"),
    ],
)
def test_other_bad_save_arguments_fail_before_anything_is_written(
    tmp_path: Path, old: Path, case: str, expected: str
) -> None:
    kwargs: dict = {}
    target = old
    if case == "missing config file":
        kwargs["config_files"] = [tmp_path / "no-such-config.json"]
    elif case == "missing parent directory":
        target = tmp_path / "no-such-dir" / "ckpt"
    else:
        kwargs["policy"] = wb.SavePolicy.gather_only("world")
    before = _snapshot(old)
    with pytest.raises(CheckpointError, match=expected):
        wb.save_hf(_model(), target, **kwargs)
    assert _snapshot(old) == before
    assert not (tmp_path / "no-such-dir").exists()


def test_an_invalid_fp32_keys_pattern_is_a_clear_error(tmp_path: Path, old: Path) -> None:
    before = _snapshot(old)
    with pytest.raises(wb.errors.WorkbenchError, match=r"fp32_keys_pattern.*'\('"):
        wb.save_hf(_model(), old, fp32_keys_pattern=["norm", "("])
    assert _snapshot(old) == before


@pytest.mark.parametrize("bad", [{"fp32_keys_pattern": "("}, {"policy": "full"}])
def test_a_failed_save_does_not_block_the_next_save_to_the_same_path(tmp_path: Path, old: Path, bad: dict) -> None:
    before = _snapshot(old)
    with pytest.raises(Exception):  # noqa: B017 -- any error; what matters is what comes after it
        wb.save_hf(_model(), old, **bad)
    assert _snapshot(old) == before
    wb.save_hf(_model(), old)  # a corrected save to the same path
    assert set(json.loads((old / INDEX_NAME).read_text())["weight_map"]) == set(_model())


def test_loading_a_checkpoint_with_a_missing_key(tmp_path: Path) -> None:
    saved = _model()
    partial = {k: v for k, v in saved.items() if k != "layers.1.w"}
    path = tmp_path / "ckpt"
    wb.save_hf(partial, path)
    missing = "layers.1.w"

    # strict (the default): one error that lists the key and says what to do; no tensor is touched
    model = {k: torch.zeros_like(v) for k, v in saved.items()}
    with pytest.raises(CheckpointError) as info:
        wb.load_hf(model, path)
    message = str(info.value)
    assert str(path) in message and "1 key(s) missing from the checkpoint" in message and missing in message
    assert "strict=False" in message
    assert all(not v.any() for v in model.values())

    # strict=False: every other parameter loads, the missing one is left alone and listed in the report
    report = wb.load_hf(model, path, strict=False)
    assert report.missing == (missing,) and report.unexpected == () and report.mismatched == ()
    assert not report.ok and report.parameters == 3
    assert f"1 missing: ['{missing}']" in str(report)
    assert not model[missing].any()
    assert all(torch.equal(model[k], saved[k]) for k in partial)


def test_loading_a_checkpoint_with_a_mis_shaped_and_an_unexpected_key(tmp_path: Path) -> None:
    saved = {**_model(), "layers.0.w": torch.ones(4, 5, dtype=torch.bfloat16), "extra.bias": torch.ones(2)}
    path = tmp_path / "ckpt"
    wb.save_hf(saved, path)
    model = {k: torch.zeros_like(v) for k, v in _model().items()}
    with pytest.raises(CheckpointError) as info:
        wb.load_hf(model, path)
    message = str(info.value)
    assert "layers.0.w: checkpoint (4, 5), layout of 'layers.0.w' expects (4, 4)" in message
    assert "1 key(s) in the checkpoint but not in the layout" in message and "extra.bias" in message

    report = wb.load_hf(model, path, strict=False)
    assert report.unexpected == ("extra.bias",) and len(report.mismatched) == 1 and report.missing == ()
    assert report.parameters == 3 and not model["layers.0.w"].any()


# -- 4 gloo ranks: one rank's bad input fails every rank ---------------------------------------------------------------

SCENARIOS = ("bad_shape_on_rank_1", "missing_parameter_on_rank_1")
BAD_RANK = 1
TIMEOUT = 6.0  # the first scenario takes well under a second; a hang in the second costs this much


def _save_with_one_bad_rank(root: str, records: str) -> dict:
    """Every rank saves an 8x4 'w' (Shard(0) over 4 ranks) and a 4-vector 'b'; rank 1's input is bad.

    Each scenario's outcome is written to ``records/rank{r}.json`` at once, so a later hang does not lose it.
    """
    import json
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import workbench as wb
    from workbench.errors import WorkbenchError

    rank = dist.get_rank()
    mesh = wb.MeshSpec((4,), ("fsdp",))
    specs = {
        "w": wb.LoadSpec.from_placements("w", "w", (8, 4), mesh, [Shard(0)]),
        "b": wb.LoadSpec.from_placements("b", "b", (4,), mesh, [Shard(0)]),
    }
    layout = wb.Layout(mesh, specs, {"w": "float32", "b": "float32"})
    outcomes = {}
    for scenario in ("bad_shape_on_rank_1", "missing_parameter_on_rank_1"):
        state = {"w": torch.full((2, 4), float(rank)), "b": torch.ones(1)}
        if rank == 1 and scenario == "bad_shape_on_rank_1":
            state["w"] = torch.zeros(3, 4)
        if rank == 1 and scenario == "missing_parameter_on_rank_1":
            del state["b"]
        start = time.perf_counter()
        try:
            wb.save_hf(state, Path(root) / scenario, layout=layout)
            outcomes[scenario] = {"error": None}
        except Exception as exc:
            kind = "WorkbenchError" if isinstance(exc, WorkbenchError) else "other"
            outcomes[scenario] = {"error": type(exc).__name__, "kind": kind, "message": str(exc)}
        outcomes[scenario]["seconds"] = time.perf_counter() - start
        (Path(records) / f"rank{rank}.json").write_text(json.dumps(outcomes))
    return outcomes


@pytest.fixture(scope="module")
def one_bad_rank(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One launch for both scenarios: old checkpoints before and after, every rank's outcomes, the launch error."""
    root, records = tmp_path_factory.mktemp("one-bad-rank"), tmp_path_factory.mktemp("records")
    for scenario in SCENARIOS:
        wb.save_hf({"old.weight": torch.arange(6.0).reshape(2, 3)}, root / scenario)
    before = {s: _snapshot(root / s) for s in SCENARIOS}
    start = time.perf_counter()
    error = None
    try:
        wb.launch(_save_with_one_bad_rank, nprocs=4, args=(str(root), str(records)), timeout=TIMEOUT)
    except wb.LaunchError as exc:
        error = exc
    elapsed = time.perf_counter() - start
    outcomes = {}
    for rank in range(4):
        record = records / f"rank{rank}.json"
        outcomes[rank] = json.loads(record.read_text()) if record.is_file() else {}
    after = {s: _snapshot(root / s) for s in SCENARIOS}
    return {"before": before, "after": after, "outcomes": outcomes, "error": error, "elapsed": elapsed}


@pytest.mark.slow
def test_one_rank_with_a_bad_local_shape_fails_every_rank_and_publishes_nothing(one_bad_rank: dict) -> None:
    scenario = "bad_shape_on_rank_1"
    for rank in range(4):
        outcome = one_bad_rank["outcomes"][rank].get(scenario)
        assert outcome is not None, f"rank {rank} never finished {scenario}: {one_bad_rank['error']}"
        assert outcome["error"] == "SaveFailed", (rank, outcome)  # the same error on every rank
        message = outcome["message"]
        assert "failed; nothing was published" in message, message
        assert (
            "rank 1 failed while planning the save: CheckpointError: parameter 'w': local tensor has shape (3, 4), "
            "the layout says (2, 4)" in message
        ), message
        # it ended before the launch's watchdog (TIMEOUT): agreed at once, nobody waited for a peer
    assert one_bad_rank["after"][scenario] == one_bad_rank["before"][scenario]  # old checkpoint intact


@pytest.mark.slow
def test_one_rank_missing_a_parameter_fails_every_rank_without_a_hang(one_bad_rank: dict) -> None:
    scenario = "missing_parameter_on_rank_1"
    assert one_bad_rank["after"][scenario] == one_bad_rank["before"][scenario]  # holds even with the bug
    bad = one_bad_rank["outcomes"][BAD_RANK].get(scenario)
    assert bad is not None and bad["kind"] == "WorkbenchError" and "'b'" in bad["message"], bad
    for rank in range(4):
        outcome = one_bad_rank["outcomes"][rank].get(scenario)
        assert outcome is not None, f"rank {rank} hung in {scenario}:\n{one_bad_rank['error']}"
        assert outcome["kind"] == "WorkbenchError", (rank, outcome)
        assert "'b'" in outcome["message"], (rank, outcome)
        if rank != BAD_RANK:  # the bad rank raises its own error unchanged; its peers name it
            assert f"rank {BAD_RANK}" in outcome["message"], (rank, outcome)
    assert one_bad_rank["error"] is None
