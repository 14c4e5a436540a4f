"""workbench: derive, plan, show, run and debug sharded HuggingFace checkpoints of DTensor training runs.

The public API (DESIGN.md section 4); everything else is reachable through its subpackage.
"""

from workbench import report, viz
from workbench.debug import Finding, Report, diagnose, diff_checkpoints, inspect_checkpoint
from workbench.errors import PeersAbsent
from workbench.io.dcp.convert import dcp_to_hf
from workbench.io.dcp.planners import DCPLoadPlanner, DCPSavePlanner
from workbench.io.files.ownership import clean_incomplete, latest_checkpoint
from workbench.io.hf.load import LoadReport, load_hf
from workbench.io.hf.save import AsyncSave, SaveResult, release_host_pool, save_hf, warm_host_pool
from workbench.io.hf.save_timings import SaveTimings
from workbench.layout import InterleavedShard, LoadSpec, Run, ShardDescriptor, compute_runs
from workbench.layout.layout_file import load_layout, save_layout
from workbench.layout.model_layout import Layout
from workbench.layout.strided import strided_shard
from workbench.mesh import MeshSpec
from workbench.plan import (
    HFLoadPlan,
    HFSavePlan,
    SavePolicy,
    UnshardSchedule,
    plan_hf_load,
    plan_hf_save,
    schedule_unshard,
)
from workbench.run.guard import LoadFailed, SaveFailed
from workbench.run.launcher import LaunchError, launch
from workbench.run.simulated import SimulatedWorld
from workbench.version import __version__

__all__ = [
    "AsyncSave",
    "DCPLoadPlanner",
    "DCPSavePlanner",
    "Finding",
    "HFLoadPlan",
    "HFSavePlan",
    "InterleavedShard",
    "LaunchError",
    "Layout",
    "LoadFailed",
    "LoadReport",
    "LoadSpec",
    "MeshSpec",
    "PeersAbsent",
    "Report",
    "Run",
    "SaveFailed",
    "SavePolicy",
    "SaveResult",
    "SaveTimings",
    "ShardDescriptor",
    "SimulatedWorld",
    "UnshardSchedule",
    "__version__",
    "clean_incomplete",
    "compute_runs",
    "dcp_to_hf",
    "diagnose",
    "diff_checkpoints",
    "inspect_checkpoint",
    "latest_checkpoint",
    "launch",
    "load_hf",
    "load_layout",
    "plan_hf_load",
    "plan_hf_save",
    "release_host_pool",
    "report",
    "save_hf",
    "save_layout",
    "schedule_unshard",
    "strided_shard",
    "viz",
    "warm_host_pool",
]
