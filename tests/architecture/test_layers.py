"""Imports go only downward, through the layers ``docs/architecture.md`` section 6 lists, and form no circle.

The table in the document is the contract: each row is a layer (its modules) and the layers it imports, and a
row may name only rows above it. These tests read that table and the code's imports (``imports.py``, from the
source with ``ast``, lazy imports included) and fail on an import up a layer, on a layer that imports something
its row does not say (or no longer imports what its row says), and on any import circle between modules.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.architecture.imports import PACKAGE_ROOT, Import, cycles, imports, modules

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
_MARK = "<!-- layer table: checked by tests/architecture/test_layers.py -->"


def layer_table(text: str) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """Rows of the layer table: (layer, its modules relative to ``workbench.``, the layers it imports)."""
    if _MARK not in text:
        raise AssertionError(f"{DOC}: the layer table's marker {_MARK!r} is missing")
    rows = []
    for line in text.split(_MARK, 1)[1].strip().splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        layer, mods, uses = cells[0].strip("`* "), cells[1], cells[2]
        rows.append((layer, tuple(re.findall(r"`([\w.]+)`", mods)),
                     tuple(re.findall(r"[\w.]+", uses)) if uses not in ("", "-", "—") else ()))
    return rows


@pytest.fixture(scope="module")
def table() -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    return layer_table(DOC.read_text())


@pytest.fixture(scope="module")
def edges() -> list[Import]:
    return imports()


def layer_of(module: str, table: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> str | None:
    """The layer whose modules hold ``module`` (the longest match: ``run.kernel`` before ``run``)."""
    best, length = None, -1
    relative = module.removeprefix("workbench").removeprefix(".") or "__init__"
    for layer, mods, _ in table:
        for m in mods:
            if (relative == m or relative.startswith(m + ".")) and len(m) > length:
                best, length = layer, len(m)
    return best


def test_the_table_names_each_layer_once_and_imports_only_from_rows_above(table):
    names = [row[0] for row in table]
    assert len(names) == len(set(names)), f"a layer is listed twice: {names}"
    for position, (layer, _, uses) in enumerate(table):
        for used in uses:
            assert used in names[:position], (
                f"docs/architecture.md: layer {layer!r} may import {used!r}, which is not a row above it")


def test_every_module_belongs_to_a_layer(table):
    homeless = [m for m in modules() if layer_of(m, table) is None]
    assert not homeless, f"modules in no layer of docs/architecture.md's table: {homeless}"


def test_no_import_goes_up_or_sideways(table, edges):
    order = {row[0]: i for i, row in enumerate(table)}
    wrong = []
    for e in edges:
        a, b = layer_of(e.source, table), layer_of(e.target, table)
        if a != b and order[b] > order[a]:
            wrong.append(f"{e.source} (layer {a}) imports {e.target} (layer {b}, below it in the table) at line "
                         f"{e.line}{' (lazy)' if e.lazy else ''}")
    assert not wrong, "imports up a layer:\n  " + "\n  ".join(wrong)


def test_each_row_lists_exactly_the_layers_its_code_imports(table, edges):
    used: dict[str, set[str]] = {row[0]: set() for row in table}
    for e in edges:
        a, b = layer_of(e.source, table), layer_of(e.target, table)
        if a != b:
            used[a].add(b)
    differ = [f"{layer}: table says {sorted(uses)}, code imports {sorted(used[layer])}"
              for layer, _, uses in table if set(uses) != used[layer]]
    assert not differ, "docs/architecture.md's layer table is out of date:\n  " + "\n  ".join(differ)


def test_no_import_circles(edges):
    found = cycles(edges)
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("core", ["workbench.mesh", "workbench.layout", "workbench.plan"])
def test_the_exact_core_imports_no_presentation_and_no_runtime(core, edges):
    banned = ("workbench.viz", "workbench.report", "workbench.io", "workbench.run", "workbench.debug")
    wrong = [f"{e.source}:{e.line} imports {e.target}" for e in edges
             if (e.source == core or e.source.startswith(core + "."))
             and any(e.target == b or e.target.startswith(b + ".") for b in banned)]
    assert not wrong, f"{core} must stay free of viz, report, io, run and debug:\n  " + "\n  ".join(wrong)


def test_the_graph_reader_sees_lazy_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "workbench"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workbench.high import c\n"
        "def f():\n    from workbench.high import b\n")
    (pkg / "high.py").write_text("from workbench.low import a\nfrom . import low\n")
    found = {(e.source, e.target, e.lazy) for e in imports(pkg)}
    assert found == {("workbench.low.a", "workbench.high", True), ("workbench.high", "workbench.low.a", False),
                     ("workbench.high", "workbench.low", False)}
    assert cycles(imports(pkg)) == [["workbench.high", "workbench.low.a"]]
    assert PACKAGE_ROOT.name == "workbench"
