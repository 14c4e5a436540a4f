"""Checkpoint I/O, one package per job:

- ``io.files``: safetensors files on one process: file plans, writing (streamed and in place), sliced reading,
  index and headers, atomic publish, owner markers, host buffers. Never talks to another rank.
- ``io.hf``: ``save_hf`` and ``load_hf``, the distributed entry points built on ``io.files`` and ``workbench.run``
  (exported from ``workbench`` itself).
- ``io.dcp``: torch DCP planners and ``dcp_to_hf``.
- ``io.pipeline``: pipeline-parallel saves.

The names exported here are the one-process file layer's.
"""

from workbench.io.files.file_plan import FilePlan, FileSpec, plan_files
from workbench.io.files.index import (
    INDEX_NAME,
    CheckpointIndex,
    KeyInfo,
    read_checkpoint,
    safetensors_dtype,
    scan_checkpoint,
    torch_dtype,
    write_index,
)
from workbench.io.files.publish import AtomicRenamePublisher, is_complete, validate_final
from workbench.io.files.publish_types import Publisher, temporary_path
from workbench.io.files.read import CheckpointReader
from workbench.io.files.write import fsync_dir, write_safetensors

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
