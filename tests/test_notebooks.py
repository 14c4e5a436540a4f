"""Every notebook under notebooks/ runs top to bottom (nbclient) on the kernel its own metadata names.

Notebooks on ``python3`` run on the test interpreter's kernel; a notebook on a workbench SPMD kernel
(``workbench-BACKEND-N``) gets that kernel installed into a temp prefix that Jupyter finds through JUPYTER_PATH.
Cells tagged ``raises-exception`` show an error on purpose.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_WORKBENCH_KERNEL = re.compile(r"workbench-(gloo|nccl)-(\d+)")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook = nbformat.read(path, as_version=4)
    kernel_name = notebook.metadata.get("kernelspec", {}).get("name", "python3")
    if kernel_name != "python3":
        from workbench.kernel.spec import install_kernel

        match = _WORKBENCH_KERNEL.fullmatch(kernel_name)
        assert match, f"{path.name}: kernel {kernel_name!r} is neither python3 nor workbench-BACKEND-N"
        install_kernel(nprocs=int(match.group(2)), backend=match.group(1), name=kernel_name, prefix=str(tmp_path))
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(notebook, timeout=300, kernel_name=kernel_name, resources=resources).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code"
               and "raises-exception" not in c.metadata.get("tags", []) for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    expected = [c for c in notebook.cells if "raises-exception" in c.metadata.get("tags", [])]
    assert all(any(o.output_type == "error" for o in c.outputs) for c in expected), "a tagged cell did not raise"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_has_an_id(path: Path) -> None:
    """nbformat 4.5 wants an id on every cell (a cell added by hand without one is a warning now, an error later)."""
    import json

    cells = json.loads(path.read_text())["cells"]
    assert [i for i, cell in enumerate(cells) if "id" not in cell] == []
