"""Layout core: placements -> ordered shard descriptors -> per-rank runs, key regions and coverage."""

from workbench.layout.coverage import Box, CoverageReport, check_coverage
from workbench.layout.descriptors import ShardDescriptor
from workbench.layout.interleaved import InterleavedShard
from workbench.layout.load_spec import KeyRegion, LoadSpec, compute_runs
from workbench.layout.normalize import normalize_placements
from workbench.layout.runs import Run

__all__ = [
    "Box",
    "CoverageReport",
    "InterleavedShard",
    "KeyRegion",
    "LoadSpec",
    "Run",
    "ShardDescriptor",
    "check_coverage",
    "compute_runs",
    "normalize_placements",
]
