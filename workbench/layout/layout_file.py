"""Layout files (TOML): a mesh and parameter templates that expand into a Layout.

Format (``sample_meshes/README.md`` has the full reference)::

    name = "toy-expert-tp"
    [mesh]
    shape = [2, 2, 2]
    dim_names = ["fsdp", "ep", "tp"]

    [[param]]
    name = "layers.{layer}.experts.fused_w1w3"
    for = { layer = 2 }                         # expand over range(2); also a list or "3:61"
    hf_keys = ["layers.{layer}.experts.{e}.gate_proj.weight", "layers.{layer}.experts.{e}.up_proj.weight"]
    keys_for = { e = 2 }                        # expand key templates: e outer, template order inner
    global_shape = [16, 3]
    fused_dim = 0
    placements = ["SS(0,4)", "S(0)", "IS(0,2)"]  # one per entry of mesh_dims (default: every mesh dim)
    mesh_dims = ["fsdp", "ep", "tp"]             # optional; "dp+ep" is a flattened group
    dtype = "bfloat16"

Placements: ``R`` (Replicate), ``S(d)`` (Shard), ``SS(d,k)`` (torch ``_StridedShard`` with split factor
k, as FSDP2 prepends it), ``IS(d,F)`` (InterleavedShard), ``P`` (Partial, always rejected).
"""

from __future__ import annotations

import itertools
import math
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from workbench import _compat
from workbench.errors import LayoutError, LayoutFileError
from workbench.layout.interleaved import InterleavedShard
from workbench.layout.layout_toml import NO_DTYPE, layout_to_toml
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

__all__ = [
    "LAYOUT_FILE_NAME", "layout_from_toml", "layout_to_toml", "load_layout", "parse_layout", "parse_placement",
    "read_checkpoint_layout", "read_layout_toml", "save_layout", "write_checkpoint_layout",
]

MAX_LAYOUT_KEYS = 10_000_000  # HF keys a layout file may expand to (DeepSeek-V3 has ~47k; a 2T MoE a few 100k)
MAX_LAYOUT_FILE_BYTES = 64 << 20  # the largest layout file read from a checkpoint folder

_PARAM_FIELDS = {
    "name", "for", "hf_keys", "keys_for", "global_shape", "fused_dim", "origin_shape", "placements",
    "mesh_dims", "dtype",
}
_PLACEMENT = re.compile(r"^\s*(R|P|S|SS|IS|Shard|Replicate|Partial)\s*(?:\(\s*([^)]*)\))?\s*$")


def parse_placement(text: str) -> Any:
    """A torch placement from its short form: ``R``, ``S(0)``, ``SS(0,4)``, ``IS(0,2)``, ``P``."""
    match = _PLACEMENT.match(text) if isinstance(text, str) else None
    if not match:
        raise LayoutError(f"placement {text!r} is not one of R, S(dim), SS(dim,split_factor), IS(dim,F), P")
    kind, args = match.group(1), [a.strip() for a in (match.group(2) or "").split(",") if a.strip()]
    try:
        numbers = [int(a) for a in args]
    except ValueError:
        raise LayoutError(f"placement {text!r} has non-integer arguments") from None
    arity = {"R": 0, "Replicate": 0, "P": 0, "Partial": 0, "S": 1, "Shard": 1, "SS": 2, "IS": 2}[kind]
    if len(numbers) != arity:
        raise LayoutError(f"placement {text!r} takes {arity} argument(s), got {len(numbers)}")
    if kind in ("R", "Replicate"):
        return Replicate()
    if kind in ("P", "Partial"):
        return Partial()
    if kind in ("S", "Shard"):
        return Shard(numbers[0])
    if numbers[1] < 1:
        raise LayoutError(f"placement {text!r} needs a factor >= 1")
    if kind == "SS":
        return _compat.make_strided_shard(numbers[0], numbers[1])
    return InterleavedShard(numbers[0], numbers[1])


def load_layout(path: str | Path) -> Layout:
    """Read a layout file (TOML) into a ``Layout``; errors name the file, line and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise LayoutFileError(f"cannot read layout file {str(path)!r}: {exc.strerror}") from None
    return parse_layout(text, source=str(path))


def parse_layout(text: str, *, source: str = "<string>") -> Layout:
    """Parse the TOML text of a layout file (see the module docstring for the format)."""
    return layout_from_toml(read_layout_toml(text, source=source), source=source, text=text)


def read_layout_toml(text: str, *, source: str = "<string>") -> dict[str, Any]:
    """The parsed TOML of a layout file's text, for ``layout_from_toml``.

    Raises:
        LayoutFileError: the text is not TOML (named with ``source`` and the parser's line).
    """
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LayoutFileError(f"{source}: not valid TOML: {exc}") from None


def layout_from_toml(doc: Mapping[str, Any], *, source: str = "<string>", text: str = "") -> Layout:
    """The ``Layout`` of a parsed layout file (``read_layout_toml``), its errors named with ``source``; ``text``, the
    file's text where the caller has it, adds the line of a bad ``[[param]]`` to them."""
    header_lines = [i + 1 for i, line in enumerate(text.splitlines()) if line.strip() == "[[param]]"]
    unknown = set(doc) - {"name", "description", "mesh", "param", "defaults", "notes", "pipeline"}
    if unknown:
        raise LayoutFileError(f"{source}: unknown top-level field(s) {sorted(unknown)}")
    mesh_doc = doc.get("mesh")
    if not isinstance(mesh_doc, dict) or "shape" not in mesh_doc:
        raise LayoutFileError(f"{source}: needs a [mesh] table with shape = [...] and dim_names = [...]")
    unknown = set(mesh_doc) - {"shape", "dim_names", "ranks"}
    if unknown:
        raise LayoutFileError(f"{source}: [mesh]: unknown field(s) {sorted(unknown)}; known: dim_names, ranks, shape")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict) or set(defaults) - {"dtype"}:
        raise LayoutFileError(f"{source}: [defaults] may only set dtype, got {defaults!r}")
    try:
        ranks = mesh_doc.get("ranks")
        mesh = MeshSpec(
            tuple(mesh_doc["shape"]), tuple(mesh_doc.get("dim_names", ())), None if ranks is None else tuple(ranks)
        )
    except (LayoutError, TypeError) as exc:
        raise LayoutFileError(f"{source}: [mesh]: {exc}") from None
    params = doc.get("param", [])
    if not isinstance(params, list) or not params:
        raise LayoutFileError(f"{source}: needs at least one [[param]] table")
    specs: dict[str, LoadSpec] = {}
    dtypes: dict[str, str] = {}
    keys = 0
    for index, entry in enumerate(params):
        line = header_lines[index] if index < len(header_lines) else None
        where = f"{source}" + (f" line {line}" if line else "") + f" ([[param]] #{index + 1}"
        where += f" {entry.get('name')!r})" if isinstance(entry, dict) else ")"
        keys += _expanded_keys(entry, where)
        if keys > MAX_LAYOUT_KEYS:
            raise LayoutFileError(f"{where}: the file expands to more than {MAX_LAYOUT_KEYS:,} HF keys "
                                  "(MAX_LAYOUT_KEYS); no model has that many: a loop count is wrong")
        for spec, dtype in _expand(entry, defaults, mesh, where):
            if spec.name in specs:
                raise LayoutFileError(f"{where}: parameter {spec.name!r} is defined twice")
            specs[spec.name] = spec
            if dtype != NO_DTYPE:
                dtypes[spec.name] = dtype
    try:
        return Layout(mesh, specs, dtypes, name=str(doc.get("name", Path(source).stem)))
    except LayoutError as exc:
        raise LayoutFileError(f"{source}: {exc}") from None


def _expand(entry: Any, defaults: Mapping[str, Any], mesh: MeshSpec, where: str) -> Iterator[tuple[LoadSpec, str]]:
    if not isinstance(entry, dict):
        raise LayoutFileError(f"{where}: must be a table")
    unknown = set(entry) - _PARAM_FIELDS
    if unknown:
        raise LayoutFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_PARAM_FIELDS)}")
    for fieldname in ("name", "hf_keys", "global_shape", "placements"):
        if fieldname not in entry:
            raise LayoutFileError(f"{where}: missing field {fieldname!r}")
    try:
        placements = [parse_placement(p) for p in _list(entry["placements"], "placements")]
    except LayoutError as exc:
        raise LayoutFileError(f"{where}: field 'placements': {exc}") from None
    mesh_dims = entry.get("mesh_dims")
    if mesh_dims is not None:
        mesh_dims = [tuple(d.split("+")) if "+" in d else d for d in _list(mesh_dims, "mesh_dims")]
    dtype = entry.get("dtype", defaults.get("dtype", "float32"))
    if not isinstance(dtype, str):
        raise LayoutFileError(f"{where}: field 'dtype' must be a dtype name or \"none\", got {dtype!r}")
    templates = _list(entry["hf_keys"], "hf_keys")
    for variables in _loops(entry.get("for", {}), where, "for"):
        try:
            name = entry["name"].format(**variables)
            keys = [
                t.format(**variables, **inner)
                for inner in _loops(entry.get("keys_for", {}), where, "keys_for")
                for t in templates
            ]
        except (KeyError, IndexError) as exc:
            raise LayoutFileError(f"{where}: a template names {exc} which no 'for'/'keys_for' loop sets") from None
        try:
            spec = LoadSpec.from_placements(
                name,
                keys,
                tuple(entry["global_shape"]),
                mesh,
                placements,
                fused_dim=entry.get("fused_dim"),
                origin_shape=entry.get("origin_shape"),
                mesh_dims=mesh_dims,
            )
        except LayoutError as exc:
            raise LayoutFileError(f"{where}: {exc}") from None
        yield spec, dtype


def _expanded_keys(entry: Any, where: str) -> int:
    """How many HF keys a ``[[param]]`` table expands to (its loops' sizes multiplied; nothing is built)."""
    if not isinstance(entry, dict):
        return 0
    templates = entry.get("hf_keys")
    count = len(templates) if isinstance(templates, list) else 1
    for what in ("for", "keys_for"):
        table = entry.get(what, {})
        if isinstance(table, dict):
            count *= math.prod(len(r) for r in _ranges(table, where, what))
    return count


def _ranges(table: dict[str, Any], where: str, what: str) -> list[Sequence[Any]]:
    ranges: list[Sequence[Any]] = []
    for var, spec in table.items():
        if isinstance(spec, int) and not isinstance(spec, bool):
            ranges.append(range(spec))
        elif isinstance(spec, str) and re.fullmatch(r"\d+:\d+", spec):
            lo, hi = (int(x) for x in spec.split(":"))
            ranges.append(range(lo, hi))
        elif isinstance(spec, list):
            ranges.append(spec)
        else:
            raise LayoutFileError(f"{where}: field {what!r}: {var} = {spec!r} is not a count, 'lo:hi' or a list")
    return ranges


def _loops(table: Any, where: str, what: str) -> Iterator[dict[str, Any]]:
    if not isinstance(table, dict):
        raise LayoutFileError(f"{where}: field {what!r} must be a table like {{ layer = 48 }}")
    names, ranges = list(table), _ranges(table, where, what)
    for combo in itertools.product(*ranges):
        yield dict(zip(names, combo))


def _list(value: Any, what: str) -> Sequence[Any]:
    if isinstance(value, str) or not isinstance(value, list):
        raise LayoutFileError(f"field {what!r} must be a list, got {value!r}")
    return value


# -- writing ---------------------------------------------------------------------------------------------------------
LAYOUT_FILE_NAME = "workbench_layout.toml"  # the layout a checkpoint was saved with, in the checkpoint's folder

def save_layout(layout: Layout, path: str | Path) -> Path:
    """Write ``layout`` to ``path`` as a layout file (TOML, ``Layout.to_toml``) that ``load_layout`` reads back.

    The file is written beside its final name and renamed into place, so a reader never sees half a file.
    Returns the path written.
    """
    path = Path(path)
    _write_atomically(path, layout_to_toml(layout))
    return path


def write_checkpoint_layout(layout: Layout, directory: str | Path) -> Path:
    """Write the layout a checkpoint was saved with into its folder, as ``LAYOUT_FILE_NAME`` (fsynced).

    ``wb.diagnose`` reads it back to name the ranks (with their mesh coordinates) whose shard a differing region
    was. Returns the path written.
    """
    path = Path(directory) / LAYOUT_FILE_NAME
    _write_atomically(path, layout_to_toml(layout), fsync=True)
    return path


def read_checkpoint_layout(directory: str | Path) -> Layout | None:
    """The layout a checkpoint folder carries (``LAYOUT_FILE_NAME``), or None when it has none.

    Raises:
        LayoutFileError: the file is there but cannot be read or parsed (the message names it).
    """
    path = checkpoint_layout_path(directory)
    return None if path is None else load_layout(path)


def checkpoint_layout_path(directory: str | Path) -> Path | None:
    """The layout file of a checkpoint folder, or None when it has none; a file larger than
    ``MAX_LAYOUT_FILE_BYTES`` is a ``LayoutFileError`` naming it (never read)."""
    path = Path(directory) / LAYOUT_FILE_NAME
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > MAX_LAYOUT_FILE_BYTES:
        raise LayoutFileError(f"{path}: {size:,} bytes, more than a layout file may have (MAX_LAYOUT_FILE_BYTES, "
                              f"{MAX_LAYOUT_FILE_BYTES:,}); not read")
    return path


def _write_atomically(path: Path, text: str, *, fsync: bool = False) -> None:
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
