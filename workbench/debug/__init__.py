"""Debug checkpoints: inspect headers, diff against a reference, diagnose with the transform that explains it."""

from workbench.debug.diagnose import diagnose
from workbench.debug.diff import diff_checkpoints
from workbench.debug.findings import KINDS, Finding, Report
from workbench.debug.inspect import FileSummary, Inspection, KeyGroup, inspect_checkpoint

__all__ = [
    "KINDS",
    "FileSummary",
    "Finding",
    "Inspection",
    "KeyGroup",
    "Report",
    "diagnose",
    "diff_checkpoints",
    "inspect_checkpoint",
]
