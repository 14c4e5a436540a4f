"""Debug checkpoints: inspect headers, diff against a reference, diagnose with the transform that explains it."""

from workbench.debug.diagnose import diagnose
from workbench.debug.diff import diff_checkpoints
from workbench.debug.findings import KINDS, Finding, FindingGroup, Report
from workbench.debug.inspect import FileSummary, Inspection, KeyGroup, inspect_checkpoint

__all__ = [
    "KINDS",
    "FileSummary",
    "Finding",
    "FindingGroup",
    "Inspection",
    "KeyGroup",
    "Report",
    "diagnose",
    "diff_checkpoints",
    "inspect_checkpoint",
]
