"""A layout file is a pipeline's when its parsed TOML has a top-level ``pipeline``, whatever the table's text looks
like; the rest of the document is the one-mesh layout the stages split. The old code read a checkpoint's layout
file twice and took text that is not TOML, or a ``pipeline`` that is not a table, for a one-mesh layout: the
checkpoint reader said "no pipeline" for a file it could not parse, and the CLI read ``pipeline = "pp"`` as one
mesh without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pipeline.toy_pipeline_text import FLAT, TABLES, with_table
from workbench.errors import LayoutFileError
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import (
    PipelineLayout,
    load_any_layout,
    parse_pipeline_layout,
    read_checkpoint_pipeline_layout,
)


@pytest.mark.parametrize(("header", "body"), TABLES)
def test_any_pipeline_table_reads_as_stages_from_a_file_and_a_checkpoint(tmp_path: Path, header: str,
                                                                         body: str) -> None:
    text = with_table(header, body)
    (tmp_path / "workbench_layout.toml").write_text(text)
    for pipeline in (load_any_layout(tmp_path / "workbench_layout.toml"), read_checkpoint_pipeline_layout(tmp_path),
                     parse_pipeline_layout(text)):
        assert isinstance(pipeline, PipelineLayout)
        assert [list(s.specs) for s in pipeline.stages] == [["b"], ["a"]]
        assert pipeline.stage_ranks(1) == (2, 3)
    flat = load_any_layout(tmp_path / "workbench_layout.toml", pipelines=False)
    assert isinstance(flat, Layout) and list(flat.specs) == ["a", "b"]


def test_the_word_pipeline_in_a_string_or_comment_leaves_a_file_flat(tmp_path: Path) -> None:
    text = FLAT.replace('name = "toy"', 'name = "[pipeline]"\n# [pipeline]\ndescription = """\n[pipeline]\n"""')
    (tmp_path / "workbench_layout.toml").write_text(text)
    layout = load_any_layout(tmp_path / "workbench_layout.toml")
    assert isinstance(layout, Layout) and layout.name == "[pipeline]"
    assert read_checkpoint_pipeline_layout(tmp_path) is None


def test_a_checkpoint_layout_file_that_is_not_toml_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "workbench_layout.toml").write_text(FLAT + "[pipeline\nmesh_dim = 'pp'\n")
    with pytest.raises(LayoutFileError, match=r"workbench_layout\.toml: not valid TOML"):
        read_checkpoint_pipeline_layout(tmp_path)


def test_a_pipeline_that_is_not_a_table_is_refused_not_read_as_one_mesh(tmp_path: Path) -> None:
    (tmp_path / "workbench_layout.toml").write_text('pipeline = "pp"\n' + FLAT)
    for read in (lambda: load_any_layout(tmp_path / "workbench_layout.toml"),
                 lambda: read_checkpoint_pipeline_layout(tmp_path)):
        with pytest.raises(LayoutFileError, match=r"workbench_layout\.toml: a pipeline layout file needs a "
                                                  r"\[pipeline\] table"):
            read()
