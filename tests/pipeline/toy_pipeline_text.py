"""The text of a toy pipeline layout file, shared by the pipeline-table tests of the Python API and the CLI."""

from __future__ import annotations

# two parameters on a (pp=2, fsdp=2) mesh, written by hand: "a" cut over fsdp, "b" replicated; no [pipeline] table
FLAT = ('name = "toy"\n[mesh]\nshape = [2, 2]\ndim_names = ["pp", "fsdp"]\n'
        '[[param]]\nname = "a"\nhf_keys = ["a"]\nglobal_shape = [4]\nmesh_dims = ["fsdp"]\nplacements = ["S(0)"]\n'
        '[[param]]\nname = "b"\nhf_keys = ["b"]\nglobal_shape = [4]\nmesh_dims = ["fsdp"]\nplacements = ["R"]\n')

# (header, table body), valid TOML all: each puts "b" on stage 0 and "a" on stage 1; lists over lines, a comment
# after the header, spaces in it, and stage_layers as explicit lists were each misread by text matching once
TABLES = [
    ("[pipeline]", 'stage_params = [\n  ["b"],\n  ["a"],\n]'),
    ("[pipeline]  # the stages", 'stage_params = [["b"], ["a"]]'),
    ("[ pipeline ]", 'stage_params = [["b"],\n ["a"]]'),
    ("[pipeline]", 'first_stage = ["b"]\nlast_stage = ["a"]\nstage_layers = [\n  [],\n  [],\n]'),
]


def with_table(header: str, body: str) -> str:
    """``FLAT`` with a pipeline table of ``mesh_dim = "pp"`` and ``body`` under ``header``."""
    return f'{FLAT}{header}\nmesh_dim = "pp"\n{body}\n'
