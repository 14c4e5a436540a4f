"""The import graph of workbench, read from its source with ``ast``: every ``import`` of a workbench module, at
module level or inside a function (a lazy import is still a dependency), except under ``if TYPE_CHECKING:``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "workbench"


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` (both dotted module names) at ``line``; ``lazy`` when inside a function."""

    source: str
    target: str
    line: int
    lazy: bool


def modules(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(root: Path = PACKAGE_ROOT) -> list[Import]:
    """Every import of a workbench module by a workbench module. ``from pkg import name`` counts as an import of
    ``pkg.name`` when that is a module, else of ``pkg``."""
    known = modules(root)
    edges: list[Import] = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges += _walk(ast.parse(path.read_text(), str(path)), name, package, known, lazy=False)
    return edges


def _walk(node: ast.AST, source: str, package: str, known: dict[str, Path], lazy: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (i for c in child.orelse for i in _walk(c, source, package, known, lazy))
            continue
        if isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                base = ".".join(parts + ([child.module] if child.module else []))
            if base.split(".")[0] == "workbench":
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    yield Import(source, target if target in known else base, child.lineno, lazy)
        elif isinstance(child, ast.Import):
            for alias in child.names:
                if alias.name.split(".")[0] == "workbench":
                    yield Import(source, alias.name, child.lineno, lazy)
        inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, source, package, known, inner)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (import circles), each sorted, found with Tarjan's
    algorithm. An import of a module's own package (``workbench.io`` from ``workbench.io.x``) is not an edge: the
    package's ``__init__`` runs first anyway."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target and not e.source.startswith(e.target + "."):
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the package's module count (~200)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
