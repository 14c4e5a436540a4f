"""Layout to TOML: the text of a layout file that ``parse_layout`` reads back into an equal layout.

The writing half of layout files (``layout_file.py`` reads them and puts them on disk): the text depends only
on a layout's mesh and LoadSpecs, so ``Layout.to_toml`` uses it without importing the reader.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workbench.memo import LRU, remember_while_same
from workbench.mesh import format_mesh_dim

if TYPE_CHECKING:
    from workbench.layout.model_layout import Layout

__all__ = ["layout_to_toml"]

# A dot-separated part is a loop number only when it is a number as ``str(int)`` writes it (ASCII digits, no leading
# zero): the reader expands ``{var}`` with ``str.format``, so ``01``, ``007`` or ``٣`` must stay literal text.
_NUMBER = re.compile(r"0|[1-9][0-9]*")
_COMPONENT_NUMBER = re.compile(r"(?<![^.])(?:0|[1-9][0-9]*)(?![^.])")  # a dot-separated part that is such a number
# A loop variable is written as a bare key of a ``for``/``keys_for`` inline table, and TOML's bare keys are ASCII
# letters, digits, ``_`` and ``-`` only: a name part of other letters (``блок``, ``é``) gets a generic variable.
_BARE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _is_number(part: str) -> bool:
    return _NUMBER.fullmatch(part) is not None


def _variable_named_after(part: str) -> str | None:
    """The loop variable named after the name part before a number (``layers`` -> ``layers``, ``conv-1`` ->
    ``conv_1``), or None when it would not be a bare TOML key that ``str.format`` reads as a name."""
    var = re.sub(r"\W", "_", part)
    return var if _BARE_VARIABLE.fullmatch(var) else None


def layout_to_toml(layout: Layout) -> str:
    """The TOML text of ``layout`` that ``parse_layout`` reads back into an equal layout (same parameters in the same
    order, same keys, shapes, cuts and given dtypes, so the same ``fingerprint``).

    Each parameter's cuts are written in forward order (``mesh_dims`` + ``S(d)``/``IS(d,F)``), which is lossless
    whatever placements made them. Key lists are written as templates with a ``keys_for`` loop where they follow
    one, and consecutive parameters that differ only in their numbers (``layers.0.x``, ``layers.1.x``) share one
    ``[[param]]`` table with a ``for`` loop; parameters are never reordered, so a layer-major layout gets one table
    per parameter of a layer. A parameter with no given dtype is written with ``dtype = "none"`` (once, in
    ``[defaults]``, when no parameter has one), so it reads back without one, not as the format's default float32.
    Remembered per layout object while its specs and dtypes are unchanged (a training
    loop's repeat saves write it at no cost; a dtype set in place is written).
    """
    return remember_while_same(_TEXTS, layout, (layout.specs, layout.dtypes), lambda: _layout_text(layout))


_TEXTS = LRU(4)
NO_DTYPE = "none"  # the dtype field of a parameter with no given dtype (a fused one saved in two dtypes)


def _layout_text(layout: Layout) -> str:
    mesh = layout.mesh
    lines = ["# written by workbench (Layout.to_toml); the format is described in sample_meshes/README.md",
             f"name = {_toml_str(layout.name)}", "", "[mesh]", f"shape = {list(mesh.shape)}",
             f"dim_names = [{', '.join(_toml_str(n) for n in mesh.dim_names)}]"]
    if mesh.ranks is not None:
        lines.append(f"ranks = {list(mesh.ranks)}")
    if not layout.dtypes:
        lines += ["", "[defaults]", f"dtype = {_toml_str(NO_DTYPE)}  # no parameter has a given dtype"]
    for entry in _merge_runs([_entry(layout, name) for name in layout.specs]):
        lines += ["", "[[param]]", *entry]
    return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's; DEL, which TOML wants escaped, is escaped too)."""
    import json

    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _escape(text: str) -> str:
    """``text`` as a ``str.format`` template that gives back ``text`` (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _template(name: str, taken: set[str]) -> tuple[str, tuple[str, ...], tuple[int, ...]]:
    """``(template, variable names, values)``: every whole-number component of a dotted name is a variable named
    after the component before it (``layers.3.mlp`` -> ``layers.{layers}.mlp``)."""
    parts = name.split(".")
    names: list[str] = []
    values: list[int] = []
    out = []
    for i, part in enumerate(parts):
        if not _is_number(part):
            out.append(_escape(part))
            continue
        var = _variable_named_after(parts[i - 1]) if i else None
        if var is None or var in taken or var in names:
            var = next(f"n{k}" for k in itertools.count() if f"n{k}" not in taken and f"n{k}" not in names)
        names.append(var)
        values.append(int(part))
        out.append("{" + var + "}")
    return ".".join(out), tuple(names), tuple(values)


def _key_templates(keys: Sequence[str], variables: Mapping[str, int], parts_of_name: Mapping[str, str],
                   shapes: Sequence[str]) -> tuple[list[str], tuple[str, Any] | None]:
    """``(templates, (inner variable, its loop) or None)`` that expand to ``keys`` exactly (see ``_expand``);
    ``shapes`` are the keys with their numbers blanked (``_COMPONENT_NUMBER``)."""
    n = len(keys)
    for t in range(1, n + 1):
        if n % t or any(shapes[i] != shapes[i % t] for i in range(t, n)):
            continue
        rows = [keys[i].split(".") for i in range(n)] if n > 1 else [keys[0].split(".")]
        found = _with_inner_loop(rows, t, n // t, variables, parts_of_name)
        if found is not None:
            return found
    return [_escape(k) for k in keys], None  # unreachable: t == n always fits


def _with_inner_loop(split: list[list[str]], t: int, count: int, variables: Mapping[str, int],
                     parts_of_name: Mapping[str, str]) -> tuple[list[str], tuple[str, Any] | None] | None:
    inner: list[int] | None = None
    inner_name = ""
    templates = []
    for j in range(t):
        rows = [split[e * t + j] for e in range(count)]
        out = []
        for pos, part in enumerate(rows[0]):
            if not _is_number(part):
                if any(r[pos] != part for r in rows):  # a literal part that the shapes' blanking hid ("#" vs "3")
                    return None
                out.append(_escape(part))
                continue
            if not all(_is_number(r[pos]) for r in rows):
                return None
            values = [int(r[pos]) for r in rows]
            before = rows[0][pos - 1] if pos else ""
            if len(set(values)) == 1:
                out.append(_constant(values[0], before, variables, parts_of_name))
                continue
            if inner is None:
                inner = values
                base = _variable_named_after(before)
                inner_name = base if base is not None and base not in variables else "k"
                while inner_name in variables:
                    inner_name += "_"
            elif values != inner:
                return None
            out.append("{" + inner_name + "}")
        templates.append(".".join(out))
    if inner is None:
        return (templates, None) if count == 1 else None
    if len(set(inner)) != len(inner):
        return None
    return templates, (inner_name, _loop(inner))


def _constant(value: int, before: str, variables: Mapping[str, int], parts_of_name: Mapping[str, str]) -> str:
    """A number that stays the same over the key loop: the name's variable of that value named like it, else the
    literal number."""
    for var, v in variables.items():
        if v == value and parts_of_name.get(var) == before:
            return "{" + var + "}"
    return str(value)


def _loop(values: Sequence[int]) -> Any:
    """A ``for`` value: a count, ``"lo:hi"`` or a list."""
    lo = values[0]
    if list(values) == list(range(lo, lo + len(values))):
        return len(values) if lo == 0 else f"{lo}:{lo + len(values)}"
    return list(values)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _entry(layout: Layout, name: str) -> tuple[str, tuple[str, ...], tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
    """``(name template, variables, their values, the table's lines with the name's numbers as variables, the
    table's lines for this parameter alone)``."""
    spec = layout.specs[name]
    template, variables, values = _template(name, set())
    parts = name.split(".")
    before = {}
    k = 0
    for i, part in enumerate(parts):
        if _is_number(part):
            before[variables[k]] = parts[i - 1] if i else ""
            k += 1
    lines = []
    shapes = [_COMPONENT_NUMBER.sub("#", k) for k in spec.hf_keys]
    for given in (dict(zip(variables, values)), {}):
        keys, inner = _key_templates(spec.hf_keys, given, before, shapes)
        lines.append([f"hf_keys = {_toml_value(keys)}"])
        if inner is not None:
            lines[-1].append(f"keys_for = {{ {inner[0]} = {_toml_value(inner[1])} }}")
    rest = [f"global_shape = {list(spec.global_shape)}"]
    if spec.fused_dim is not None:
        rest.append(f"fused_dim = {spec.fused_dim}")
    if spec.origin_shape is not None:
        rest.append(f"origin_shape = {list(spec.origin_shape)}")
    rest.append(f"mesh_dims = {_toml_value([format_mesh_dim(d.mesh_dim) for d in spec.shards])}")
    cuts = [f"IS({d.dim},{d.interleave_factor})" if d.is_interleaved else f"S({d.dim})" for d in spec.shards]
    rest.append(f"placements = {_toml_value(cuts)}  # in forward order: {spec.describe_shards() or 'replicated'}")
    given_dtype = layout.dtypes.get(name)
    if given_dtype is not None:
        rest.append(f"dtype = {_toml_str(given_dtype)}")
    elif layout.dtypes:
        rest.append(f"dtype = {_toml_str(NO_DTYPE)}  # no one dtype: not checked")
    return template, variables, values, (*lines[0], *rest), (f"name = {_toml_str(_escape(name))}", *lines[1], *rest)


def _merge_runs(entries: Sequence[tuple[str, tuple[str, ...], tuple[int, ...], tuple[str, ...], tuple[str, ...]]]
                ) -> list[tuple[str, ...]]:
    """One table per run of consecutive parameters with the same template and lines whose numbers form a product
    in loop order (the ``for`` loop expands them back in the same order); a parameter alone is written as itself."""
    tables: list[tuple[str, ...]] = []
    i = 0
    while i < len(entries):
        template, variables, _, lines, alone = entries[i]
        j = i + 1
        while j < len(entries) and variables and entries[j][0] == template and entries[j][3] == lines:
            j += 1
        if j == i + 1:
            tables.append(alone)
            i = j
            continue
        for chunk in _product_chunks([e[2] for e in entries[i:j]]):
            loops = ", ".join(f"{v} = {_toml_value(_loop(c))}" for v, c in zip(variables, chunk))
            tables.append((f"name = {_toml_str(template)}", f"for = {{ {loops} }}", *lines))
        i = j
    return tables


def _product_chunks(values: Sequence[tuple[int, ...]]) -> list[list[list[int]]]:
    """Split consecutive value tuples into runs that are each ``itertools.product`` of per-variable lists."""
    if not values:
        return []
    columns = [list(dict.fromkeys(v[d] for v in values)) for d in range(len(values[0]))]
    if list(itertools.product(*columns)) == list(values):
        return [columns]
    if len(values[0]) <= 1:  # distinct single values always form a list; repeats cannot happen in one layout
        return [[[v[0]]] for v in values]
    out: list[list[list[int]]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i][0] != values[start][0]:
            for sub in _product_chunks([v[1:] for v in values[start:i]]):
                out.append([[values[start][0]], *sub])
            start = i
    return out
