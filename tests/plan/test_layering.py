"""Layering: layout never imports plan (not even lazily), plan never imports run or io, read from the code's ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "workbench"


def imported_modules(path: Path) -> set[str]:
    """Every workbench module a file imports, at module level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("workbench")}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("layout", ("workbench.plan", "workbench.run", "workbench.io")),  # layout is below plan
        ("plan", ("workbench.run", "workbench.io")),  # planning is pure: no executor, no files
    ],
)
def test_package_does_not_import_the_layers_above(package: str, forbidden: tuple[str, ...]) -> None:
    offending = {
        f"{path.relative_to(PACKAGE.parent)}: {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for module in imported_modules(path)
        if module.startswith(forbidden)
    }
    assert not offending, sorted(offending)


def test_the_scan_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from workbench.plan.save_plan import plan_hf_save\n    import workbench.run\n")
    assert {"workbench.plan.save_plan", "workbench.run"} <= imported_modules(source)
