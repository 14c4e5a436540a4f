"""Pipeline-parallel layouts: each stage holds its own parameters on its own slice of the mesh.

A pipeline mesh has a ``pp`` dim; stage ``s`` is the sub-mesh at ``pp = s``. Unlike every other mesh dim, ``pp``
does not cut or replicate a tensor: a parameter exists only on the ranks of its stage. ``PipelineLayout`` holds
one ``Layout`` per stage, each on the stage mesh (the mesh without ``pp``) numbered by *stage-local* rank, so every
plan, schedule and save of one stage is an ordinary one-mesh problem; ``stage_ranks(s)`` maps stage-local ranks
back to global ones.

Example, mesh (pp=2, fsdp=2), layers 0-1 on stage 0 and layers 2-3 on stage 1:

====  ===========  =====================  ============================
rank  (pp, fsdp)   stage, stage-local     holds
====  ===========  =====================  ============================
0     (0, 0)       0, 0                   first half of layers 0-1
3     (1, 1)       1, 1                   second half of layers 2-3
====  ===========  =====================  ============================

Layout files: a normal layout file plus a ``[pipeline]`` table (``sample_meshes/deepseek_v3_pp.toml``)::

    [pipeline]
    mesh_dim = "pp"
    layer_pattern = 'model\\.layers\\.(\\d+)\\.'      # group 1: a parameter's layer
    stage_layers = ["0:16", "16:32", "32:47", "47:62"]
    first_stage = ['model\\.embed_tokens\\.weight']   # regexes (fullmatch) of non-layer parameters
    last_stage = ['model\\.norm\\.weight', 'lm_head\\.weight']

Its parameters list ``mesh_dims`` without ``pp`` (as every rank of a stage sees them). Instead of the rule
(``layer_pattern``, ``stage_layers``, ``first_stage``, ``last_stage``) the table may name every stage's parameters,
``stage_params = [["model.embed_tokens.weight", ...], [...]]``: that is what ``PipelineLayout.to_toml`` writes, and
what a pipeline checkpoint carries (``workbench_layout.toml``, read by ``read_checkpoint_pipeline_layout``).
Read as a plain layout file (``load_layout``), the same text is the whole model on the whole mesh with every
parameter replicated over ``pp``: right for its keys, shapes and dtypes, not for which ranks hold what.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import LayoutError, LayoutFileError
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

__all__ = ["PipelineLayout", "has_pipeline_table", "load_any_layout", "load_pipeline_layout", "parse_pipeline_layout",
           "read_checkpoint_pipeline_layout", "stage_rule"]


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """A pipeline mesh and one ``Layout`` per stage (each on the stage mesh, stage-local ranks).

    Args:
        mesh: the whole mesh, ``pp_dim`` included.
        pp_dim: the pipeline mesh dim.
        stages: the layout of every stage, in stage order; each on ``stage_mesh`` (the mesh without ``pp_dim``).
        name: a label for reports.
    """

    mesh: MeshSpec
    pp_dim: str
    stages: tuple[Layout, ...]
    name: str = "pipeline"

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        object.__setattr__(self, "stages", stages)
        pp = self.mesh.mesh_dim_index(self.pp_dim)
        if len(stages) != self.mesh.shape[pp]:
            raise LayoutError(f"PipelineLayout: mesh dim {self.pp_dim!r} has {self.mesh.shape[pp]} stages, "
                              f"{len(stages)} stage layouts were given")
        stage_mesh = self.stage_mesh
        owner: dict[str, tuple[int, str]] = {}
        for s, layout in enumerate(stages):
            if layout.mesh != stage_mesh:
                raise LayoutError(f"PipelineLayout: stage {s} is on {layout.mesh!r}, the stage mesh is {stage_mesh!r}")
            for name, spec in layout.specs.items():
                for key in spec.hf_keys:
                    if key in owner:
                        raise LayoutError(
                            f"PipelineLayout: HF key {key!r} is held by stage {owner[key][0]} ({owner[key][1]!r}) "
                            f"and stage {s} ({name!r}); every key belongs to one stage"
                        )
                    owner[key] = (s, name)

    @property
    def stage_mesh(self) -> MeshSpec:
        """The mesh of one stage: every mesh dim but ``pp_dim``, stage-local ranks ``0..S-1`` (one rank, as a plain
        model's ``world``, for a mesh of ``pp_dim`` alone)."""
        return _stage_mesh(self.mesh, self.pp_dim)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks of ``stage``, indexed by stage-local rank."""
        pp = self.mesh.mesh_dim_index(self.pp_dim)
        if not 0 <= stage < self.mesh.shape[pp]:
            raise LayoutError(f"stage {stage} is not in {self.mesh!r} ({self.pp_dim}={self.mesh.shape[pp]})")
        first = [0] * self.mesh.ndim
        first[pp] = stage
        anchor = self.mesh.rank_at(first)
        others = tuple(n for n in self.mesh.dim_names if n != self.pp_dim)
        if not others:
            return (anchor,)
        return self.mesh.group_ranks(anchor, others if len(others) > 1 else others[0])

    def stage_of_rank(self, rank: int) -> tuple[int, int]:
        """``(stage, stage-local rank)`` of a global rank."""
        stage = self.mesh.coordinate(rank)[self.mesh.mesh_dim_index(self.pp_dim)]
        return stage, self.stage_ranks(stage).index(rank)

    def stage_of(self, name: str) -> int:
        """The stage holding parameter ``name``."""
        for s, layout in enumerate(self.stages):
            if name in layout.specs:
                return s
        raise KeyError(f"no parameter {name!r} in any stage of {self!r}")

    def layout_of_rank(self, rank: int) -> Layout:
        """The layout of the stage ``rank`` belongs to (stage-local ranks)."""
        return self.stages[self.stage_of_rank(rank)[0]]

    @property
    def hf_keys(self) -> dict[str, tuple[int, str]]:
        """``{hf_key: (stage, parameter name)}`` over every stage."""
        return {k: (s, n) for s, layout in enumerate(self.stages) for n, spec in layout.specs.items()
                for k in spec.hf_keys}

    def coverage_ok(self) -> bool:
        """True when every stage's parameters are each held exactly once per replica group."""
        return all(r.ok for layout in self.stages for r in layout.coverage().values())

    @classmethod
    def from_layout(cls, layout: Layout, pp_dim: str, stage_of: Callable[[str], int], *,
                    name: str | None = None) -> PipelineLayout:
        """Split a layout whose parameters are all replicated over ``pp_dim`` (as a flat layout file or
        ``Layout.from_model`` on one stage reads them) into stages, ``stage_of(name)`` giving each one's stage.

        Raises:
            LayoutError: a parameter cut over ``pp_dim``, or a stage index out of range (both named).
        """
        pp = layout.mesh.mesh_dim_index(pp_dim)
        count = layout.mesh.shape[pp]
        stage_mesh = _stage_mesh(layout.mesh, pp_dim)
        specs: list[dict[str, LoadSpec]] = [{} for _ in range(count)]
        dtypes: list[dict[str, str]] = [{} for _ in range(count)]
        for param, spec in layout.specs.items():
            s = stage_of(param)
            if not isinstance(s, int) or not 0 <= s < count:
                raise LayoutError(f"parameter {param!r}: stage {s!r} is not one of the {count} stages of {pp_dim!r}")
            cut = [d for d in spec.shards if pp_dim in (d.mesh_dim if isinstance(d.mesh_dim, tuple) else (d.mesh_dim,))]
            if cut:
                raise LayoutError(f"parameter {param!r}: cut over the pipeline mesh dim {pp_dim!r} ({cut[0]}); a "
                                  "stage holds whole parameters (cut them over the other mesh dims)")
            specs[s][param] = LoadSpec(name=param, hf_keys=spec.hf_keys, global_shape=spec.global_shape,
                                       mesh=stage_mesh, shards=spec.shards, fused_dim=spec.fused_dim,
                                       origin_shape=spec.origin_shape)
            if param in layout.dtypes:  # only dtypes that were given: a save takes the tensors' own
                dtypes[s][param] = layout.dtypes[param]
        stages = tuple(Layout(stage_mesh, specs[s], dtypes[s], name=f"{layout.name}[{pp_dim}={s}]")
                       for s in range(count))
        return cls(layout.mesh, pp_dim, stages, name=name or layout.name)

    def flat_layout(self) -> Layout:
        """Every stage's parameters on the whole mesh, in stage order, each replicated over ``pp_dim`` (what
        ``from_layout`` splits; a flat layout file of the pipeline reads as this). Good for the keys, shapes, cuts
        and dtypes of the whole model; it says every stage holds every parameter, so rank questions go to the
        stages."""
        specs: dict[str, LoadSpec] = {}
        dtypes: dict[str, str] = {}
        for layout in self.stages:
            for param, spec in layout.specs.items():
                specs[param] = LoadSpec(name=param, hf_keys=spec.hf_keys, global_shape=spec.global_shape,
                                        mesh=self.mesh, shards=spec.shards, fused_dim=spec.fused_dim,
                                        origin_shape=spec.origin_shape)
                if param in layout.dtypes:
                    dtypes[param] = layout.dtypes[param]
        return Layout(self.mesh, specs, dtypes, name=self.name)

    def to_toml(self) -> str:
        """This pipeline as a layout file: the whole model (``flat_layout``) and a ``[pipeline]`` table naming the
        pipeline mesh dim and every stage's parameters (``stage_params``); ``load_pipeline_layout`` reads it back
        into an equal ``PipelineLayout`` (stage layouts named ``NAME[pp=s]``, as ``from_layout`` names them)."""
        from workbench.layout.layout_toml import layout_to_toml

        # one name a line
        lines = ["", "[pipeline]", f"mesh_dim = {_toml_str(self.pp_dim)}", "stage_params = [["]
        for s, layout in enumerate(self.stages):
            if s:
                lines.append("], [")
            lines.extend(f"  {_toml_str(name)}," for name in layout.specs)
        lines.append("]]")
        return layout_to_toml(self.flat_layout()) + "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        sizes = ", ".join(str(len(layout)) for layout in self.stages)
        return f"PipelineLayout({self.name!r}, mesh={self.mesh!r}, pp_dim={self.pp_dim!r}, params per stage=[{sizes}])"


def _toml_str(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's; DEL, which TOML wants escaped, is escaped too)."""
    import json

    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _stage_mesh(mesh: MeshSpec, pp_dim: str) -> MeshSpec:
    pp = mesh.mesh_dim_index(pp_dim)
    keep = [i for i in range(mesh.ndim) if i != pp]
    if not keep:  # pure pipeline parallelism: each stage is one rank holding its parameters whole
        return MeshSpec((1,), ("world",))
    return MeshSpec(tuple(mesh.shape[i] for i in keep), tuple(mesh.dim_names[i] for i in keep))


def stage_rule(
    stage_layers: Sequence[str | Sequence[int]],
    *,
    layer_pattern: str = r"(?:model\.)?layers\.(\d+)\.",
    first_stage: Sequence[str] = (),
    last_stage: Sequence[str] = (),
) -> Callable[[str], int]:
    """``name -> stage``: a layer's stage from ``stage_layers`` ("lo:hi" or explicit lists, one per stage);
    non-layer parameters matching a ``first_stage`` / ``last_stage`` regex (fullmatch) go first / last.

    Raises (when called):
        LayoutError: a parameter in no stage or in two (named with the rule that placed it).
    """
    owner: dict[int, int] = {}
    for s, spec in enumerate(stage_layers):
        layers = range(*map(int, spec.split(":"))) if isinstance(spec, str) else spec
        for layer in layers:
            if layer in owner:
                raise LayoutError(f"layer {layer} is in stage {owner[layer]} and stage {s}")
            owner[layer] = s
    pattern = re.compile(layer_pattern)
    first = [re.compile(p) for p in first_stage]
    last = [re.compile(p) for p in last_stage]
    count = len(stage_layers)

    def stage_of(name: str) -> int:
        match = pattern.match(name)
        if match:
            layer = int(match.group(1))
            if layer not in owner:
                raise LayoutError(f"parameter {name!r}: layer {layer} is in no stage "
                                  f"(stage_layers {list(stage_layers)})")
            return owner[layer]
        if any(p.fullmatch(name) for p in first):
            return 0
        if any(p.fullmatch(name) for p in last):
            return count - 1
        raise LayoutError(f"parameter {name!r} is in no stage: not a layer ({layer_pattern!r}) and not matched by "
                          f"first_stage {list(first_stage)} or last_stage {list(last_stage)}")

    return stage_of


def load_pipeline_layout(path: str | Path) -> PipelineLayout:
    """Read a layout file with a ``[pipeline]`` table (see the module docstring) into a ``PipelineLayout``.

    Raises:
        LayoutFileError: the file is not valid, the ``[pipeline]`` table is missing or has unknown fields, or a
            parameter falls in no stage (all named with the file).
    """
    path = Path(path)
    return parse_pipeline_layout(_read_layout_text(path), source=str(path))


def load_any_layout(path: str | Path, *, pipelines: bool = True) -> Layout | PipelineLayout:
    """A layout file, read and parsed once: with ``pipelines``, a ``PipelineLayout`` when it is a pipeline's (a
    ``pipeline`` table); else its ``Layout`` on one mesh (a pipeline's whole model, as ``load_layout`` reads it).

    Raises:
        LayoutFileError: the file cannot be read, is not TOML, or is not a valid layout (all named with the file).
    """
    from workbench.layout.layout_file import layout_from_toml, read_layout_toml

    path = Path(path)
    text = _read_layout_text(path)
    doc = read_layout_toml(text, source=str(path))
    if pipelines and _is_pipeline(doc):
        return _pipeline_from_toml(doc, text, str(path))
    return layout_from_toml(doc, source=str(path), text=text)


def read_checkpoint_pipeline_layout(directory: str | Path) -> PipelineLayout | None:
    """The pipeline layout a checkpoint folder carries (``workbench_layout.toml`` with a ``[pipeline]`` table, as
    ``save_hf_pipeline`` writes it), or None when it carries no layout file or one of a single mesh.

    Raises:
        LayoutFileError: the file is there but cannot be read or parsed (the message names it).
    """
    from workbench.layout.layout_file import checkpoint_layout_path, read_layout_toml

    path = checkpoint_layout_path(directory)
    if path is None:
        return None
    text = _read_layout_text(path)
    doc = read_layout_toml(text, source=str(path))
    return _pipeline_from_toml(doc, text, str(path)) if _is_pipeline(doc) else None  # a one-mesh layout: None


def has_pipeline_table(text: str) -> bool:
    """Whether a layout file's TOML text is a pipeline's: it has a top-level ``pipeline`` (parsed, not searched as
    text: a header may carry a comment or spaces, and a table's lists may span lines). Text that is not TOML has
    none (its parser says why)."""
    try:
        return _is_pipeline(tomllib.loads(text))
    except tomllib.TOMLDecodeError:
        return False


def parse_pipeline_layout(text: str, *, source: str = "<string>") -> PipelineLayout:
    """Parse the TOML text of a pipeline layout file (a layout file with a ``[pipeline]`` table)."""
    from workbench.layout.layout_file import read_layout_toml

    return _pipeline_from_toml(read_layout_toml(text, source=source), text, source)


def _is_pipeline(doc: Mapping[str, Any]) -> bool:
    """Whether a parsed layout file is a pipeline's. Any top-level ``pipeline`` counts, a table or not: one that is
    not a table is refused by ``_pipeline_from_toml``, never quietly read as a one-mesh layout."""
    return "pipeline" in doc


def _read_layout_text(path: Path) -> str:
    """A layout file's text (UTF-8); a ``LayoutFileError`` naming the file when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LayoutFileError(f"cannot read layout file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a binary file: the decoder's message does not say which
        raise LayoutFileError(f"cannot read layout file {str(path)!r}: not UTF-8 text ({exc.reason} at byte "
                              f"{exc.start})") from None


def _pipeline_from_toml(doc: Mapping[str, Any], text: str, source: str) -> PipelineLayout:
    """The ``PipelineLayout`` of a parsed pipeline layout file: its ``pipeline`` table splits the one-mesh layout
    of the rest of the file into stages (``text`` only gives errors their line)."""
    from workbench.layout.layout_file import layout_from_toml

    table = doc.get("pipeline")
    if not isinstance(table, Mapping):
        raise LayoutFileError(f"{source}: a pipeline layout file needs a [pipeline] table (mesh_dim, stage_layers, "
                              "...)")
    known = {"mesh_dim", "layer_pattern", "stage_layers", "first_stage", "last_stage", "stage_params"}
    if set(table) - known or ("stage_layers" in table) == ("stage_params" in table):
        raise LayoutFileError(f"{source}: [pipeline]: fields {sorted(table)}; known: {sorted(known)}, with "
                              "stage_layers (and its rule) or stage_params, not both")
    layout = layout_from_toml({k: v for k, v in doc.items() if k != "pipeline"}, source=source, text=text)
    pp_dim = table.get("mesh_dim", "pp")
    try:
        if "stage_params" in table:
            if set(table) - {"mesh_dim", "stage_params"}:
                raise LayoutError(f"stage_params takes no rule fields, got {sorted(set(table) - {'mesh_dim'})}")
            rule = _listed_stages(table["stage_params"], layout, pp_dim)
        else:
            rule_args = {k: table[k] for k in ("layer_pattern", "first_stage", "last_stage") if k in table}
            rule = stage_rule(table["stage_layers"], **rule_args)
        return PipelineLayout.from_layout(layout, pp_dim, rule)
    except LayoutError as exc:
        raise LayoutFileError(f"{source}: [pipeline]: {exc}") from None


def _listed_stages(stage_params: Any, layout: Layout, pp_dim: str) -> Callable[[str], int]:
    """``name -> stage`` from ``stage_params`` (one list of parameter names per stage of ``pp_dim``)."""
    count = layout.mesh.shape[layout.mesh.mesh_dim_index(pp_dim)]
    if not isinstance(stage_params, list) or not all(
            isinstance(names, list) and all(isinstance(n, str) for n in names) for names in stage_params):
        raise LayoutError("stage_params must be a list of lists of parameter names, one per stage")
    if len(stage_params) != count:
        raise LayoutError(f"stage_params lists {len(stage_params)} stages, mesh dim {pp_dim!r} has {count}")
    owner: dict[str, int] = {}
    for s, names in enumerate(stage_params):
        for name in names:
            if name not in layout.specs:
                raise LayoutError(f"stage_params: stage {s} lists {name!r}, which is not a parameter of the file")
            if owner.setdefault(name, s) != s:
                raise LayoutError(f"stage_params: parameter {name!r} is in stage {owner[name]} and stage {s}")
    unlisted = [name for name in layout.specs if name not in owner]
    if unlisted:
        raise LayoutError(f"stage_params: parameter(s) {unlisted[:3]} ({len(unlisted)} in all) are in no stage")
    return owner.__getitem__


