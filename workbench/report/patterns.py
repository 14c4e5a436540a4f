"""Layer-pattern grouping, under the name the report layer has always offered it by: the code is
``workbench.name_patterns``, a base module that every layer (plan reprs included) may import."""

from workbench.name_patterns import (
    IndexSpan,
    PatternGroup,
    compress_indices,
    group_by_pattern,
    index_spans,
    render_pattern,
    split_template,
)

__all__ = [
    "IndexSpan", "PatternGroup", "compress_indices", "group_by_pattern", "index_spans", "render_pattern",
    "split_template",
]
