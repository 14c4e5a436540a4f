"""Two gloo ranks that hold one parameter in different dtypes: every rank's save is refused naming the parameter and
each rank's dtype (not "different layouts" with a pipeline hint), before anything is written. Ranks that hold
different parameters keep the pipeline hint."""

from __future__ import annotations

from pathlib import Path

import workbench as wb

MODES = ("direct", "gather")


def _state(case: str) -> dict:
    """This rank's DTensors, rows of (8, 6) parameters (no collective); per ``case`` rank 1's differ from rank 0's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))

    def rows(dtype: torch.dtype = torch.float32) -> DTensor:
        local = torch.arange(48.0).reshape(8, 6).chunk(2)[rank].to(dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(8, 6), stride=(6, 1))

    if case == "parameters" and rank == 1:  # another stage's parameters
        return {"model.c.weight": rows()}
    # the same parameters; with case "dtype" one of them is bf16 on rank 1 only
    b_dtype = torch.bfloat16 if case == "dtype" and rank == 1 else torch.float32
    return {"model.a.weight": rows(), "model.b.weight": rows(b_dtype)}


def _save(root: str, case: str) -> dict[str, str]:
    """Every write mode's outcome on this rank: the exception's type and message."""
    state = _state(case)
    out = {}
    for mode in MODES:
        try:
            wb.save_hf(state, Path(root) / f"ckpt-{mode}", write_mode=mode, timeout=30)
            out[mode] = "OK"
        except Exception as exc:
            out[mode] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_parameter_in_two_dtypes_names_it_with_each_ranks_dtype(tmp_path: Path) -> None:
    results = wb.launch(_save, nprocs=2, args=(str(tmp_path), "dtype"), timeout=120)
    want = ("parameter 'model.b.weight' is float32 on rank(s) 0 and bfloat16 on rank(s) 1: every rank must hold it "
            "in one dtype")
    for rank, outcomes in results.items():
        for mode, outcome in outcomes.items():
            assert outcome.startswith("SaveFailed: ") and "refused before any data moved" in outcome, (rank, mode)
            assert want in outcome, (rank, mode, outcome)
            assert "different layouts" not in outcome and "save_hf_pipeline" not in outcome, (rank, mode, outcome)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no .ckpt-*.incomplete


def test_ranks_with_different_parameters_keep_the_pipeline_hint(tmp_path: Path) -> None:
    results = wb.launch(_save, nprocs=2, args=(str(tmp_path), "parameters"), timeout=120)
    for rank, outcomes in results.items():
        for mode, outcome in outcomes.items():
            assert outcome.startswith("SaveFailed: "), (rank, mode, outcome)
            assert "the ranks hold different layouts" in outcome and "save_hf_pipeline" in outcome, (rank, outcome)
            assert "dtype" not in outcome, (rank, mode, outcome)
    assert list(tmp_path.iterdir()) == []


def test_dtype_problem_names_the_first_parameter_and_counts_the_rest() -> None:
    from workbench.io.hf.save_planning import dtype_problem

    names = ["a", "b", "c"]
    same = ("d" * 16, ("float32", "float32", "float32"))
    b_bf16 = ("d" * 16, ("float32", "bfloat16", "float16"))
    assert dtype_problem(names, [same, same]) is None
    assert dtype_problem(names, [same, ("e" * 16, same[1])]) is None  # other parameters: not a dtype problem
    message = dtype_problem(names, [same, b_bf16, same])
    assert message is not None and message.startswith(
        "parameter 'b' is float32 on rank(s) 0, 2 and bfloat16 on rank(s) 1: every rank must hold it in one dtype")
    assert message.endswith("(1 more parameter(s) differ in dtype)")


def _save_other_cut(root: str) -> dict[str, str]:
    """Rank 1 holds ``model.b.weight`` cut on dim 1 where rank 0 cuts it on dim 0 (each passes its own layout)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("fsdp",))
    dim = 1 if rank == 1 else 0
    specs = {"model.a.weight": wb.LoadSpec.from_placements("model.a.weight", "model.a.weight", (8, 6), mesh,
                                                            [Shard(0)]),
             "model.b.weight": wb.LoadSpec.from_placements("model.b.weight", "model.b.weight", (8, 6), mesh,
                                                            [Shard(dim)])}
    full = torch.arange(48.0).reshape(8, 6)
    state = {"model.a.weight": full.chunk(2)[rank].clone(), "model.b.weight": full.chunk(2, dim)[rank].clone()}
    try:
        wb.save_hf(state, Path(root) / "ckpt", layout=wb.Layout(mesh, specs), timeout=30)
        return {"outcome": "OK"}
    except Exception as exc:
        return {"outcome": f"{type(exc).__name__}: {exc}"}


def test_ranks_that_cut_a_parameter_otherwise_are_told_which_and_how(tmp_path: Path) -> None:
    # the message was "rank(s) 0: 2 parameters, the first 'model.a.weight'; rank(s) 1: 2 parameters, the first
    # 'model.a.weight'": two halves alike, nothing said of what differs
    results = wb.launch(_save_other_cut, nprocs=2, args=(str(tmp_path),), timeout=120)
    for rank, got in results.items():
        outcome = got["outcome"]
        assert outcome.startswith("SaveFailed: ") and "refused before any data moved" in outcome, (rank, outcome)
        assert "parameter 'model.b.weight' differs: HF key(s) model.b.weight, shape (8, 6), cut " in outcome, outcome
        assert " on rank(s) 0; HF key(s) model.b.weight" in outcome and outcome.count("on rank(s) 1") >= 1, outcome
    assert list(tmp_path.iterdir()) == []


def test_layout_problem_names_a_parameter_one_side_lacks_and_the_mesh() -> None:
    from workbench.io.hf.save_planning import layout_problem

    a = (("mesh", "M(2)"), ("x", "cut S(0)"), ("y", "cut S(1)"))
    assert layout_problem(["f", "f"], [a, None]) is None
    assert layout_problem(["f", "g", "g"], [a, a[:2], None]) == \
        "parameter 'y' is held by rank(s) 0 and not by rank(s) 1, 2"
    assert layout_problem(["f", "g"], [a[:2], a]) == "parameter 'y' is held by rank(s) 1 and not by rank(s) 0"
    assert layout_problem(["f", "g"], [a, (("mesh", "M(4)"), *a[1:])]) == \
        "the mesh differs: M(2) on rank(s) 0; M(4) on rank(s) 1"
