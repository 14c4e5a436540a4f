"""The README's Python examples run and say what they claim."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_layout_example_runs_and_its_comments_are_true() -> None:
    block = next(b for b in _blocks() if "spec.coverage().ok" in b)
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)
    spec = scope["spec"]
    assert spec.describe_shards() == "S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp"
    assert str(spec.runs(5)[0]) == "global[6:8, 0:4] -> local[0:2, 0:4]"
    assert str(spec.key_regions(5)[0]) == "experts.0.up_proj.weight[2:4, 0:4] -> local[0:2, 0:4]"
    assert spec.coverage().ok


def test_the_plans_example_runs() -> None:
    import workbench as wb

    block = next(b for b in _blocks() if "plan_hf_load(w13, 5)" in b)
    layout = wb.load_layout(README.parent / "sample_meshes" / "toy_expert_tp.toml")
    printed: list[str] = []
    exec(compile(block, "README.md", "exec"), {"wb": wb, "layout": layout, "print": lambda x: printed.append(str(x))})
    load, full, preserve = printed
    # what the README's comments claim: exactly the owned slice is read; full undoes the cuts inner first;
    # preserve("ep") keeps each EP rank's experts
    assert "model.layers.0.mlp.experts.0.up_proj.weight[2:4, 0:4] -> local[0:2, 0:4]" in load
    assert "1 read(s)" in load
    steps = [line.split(" (")[0].strip() for line in full.splitlines()[1:]]
    assert steps == ["1. gather S(0)@fsdp", "2. gather IS(0,2)@tp", "3. gather S(0)@ep"]
    assert "keep S(0)@ep" in preserve and "(2 keys" in preserve


def test_the_async_example_runs_and_keeps_the_call_time_values() -> None:
    from workbench.io.files.read import CheckpointReader

    block = next(b for b in _blocks() if "warm_host_pool" in b)
    block = "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)
    result, state = scope["result"], scope["state"]
    with CheckpointReader(result.path) as reader:
        assert torch.equal(reader.read("layers.0.w") + 1, state["layers.0.w"])
    assert 0 < result.blocked_seconds <= result.seconds
