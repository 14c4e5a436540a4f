"""Checkpoint I/O for one process: file plans, safetensors writing, index and headers, sliced reads, atomic publish.

The modules exported here never talk to other ranks. ``hf_save`` (``wb.save_hf``) and ``hf_load``
(``wb.load_hf``) are the distributed entry points built on them and on ``workbench.run``; they are exported
from ``workbench`` itself.
"""

from workbench.io.file_plan import FilePlan, FileSpec, plan_files
from workbench.io.index import (
    INDEX_NAME,
    CheckpointIndex,
    KeyInfo,
    read_checkpoint,
    safetensors_dtype,
    scan_checkpoint,
    torch_dtype,
    write_index,
)
from workbench.io.publish import AtomicRenamePublisher, is_complete, validate_final
from workbench.io.publish_types import Publisher, temporary_path
from workbench.io.read import CheckpointReader
from workbench.io.write import fsync_dir, write_safetensors

__all__ = [
    "INDEX_NAME",
    "AtomicRenamePublisher",
    "CheckpointIndex",
    "CheckpointReader",
    "FilePlan",
    "FileSpec",
    "KeyInfo",
    "Publisher",
    "fsync_dir",
    "is_complete",
    "plan_files",
    "read_checkpoint",
    "safetensors_dtype",
    "scan_checkpoint",
    "temporary_path",
    "torch_dtype",
    "validate_final",
    "write_index",
    "write_safetensors",
]
