"""Convert a torch DCP checkpoint into an HF safetensors checkpoint, key by key, in bounded memory.

``dcp_to_hf`` uses ``save_hf``'s own writing machinery: a file plan fixed up front (``plan_files``), each file's
header written first and every key written at its byte offset as soon as it is assembled (``StreamWriter``), the
index with ``metadata.total_size``, and an atomic publish (``AtomicRenamePublisher``, verified before the rename).
DCP's resharding assembles each full runtime tensor from whatever chunks were saved (one per run with
``DCPSavePlanner``, or torch's own boxes), a batch of parameters at a time: host memory holds at most
``budget_bytes`` of tensors plus the largest one.

Per parameter: the full runtime tensor (``global_shape``) is trimmed to its checkpoint-visible shape (FP8 tail
padding dropped), cast to the key's save dtype, and split into its HF keys along ``fused_dim``.

A DCP checkpoint's ``.metadata`` is a Python pickle, and unpickling runs whatever code the file holds: like
``inspect_checkpoint``, ``dcp_to_hf`` opens it only when the caller opts in with ``allow_pickle=True``.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.io.files.file_plan import DEFAULT_MAX_SHARD_BYTES, plan_files
from workbench.io.files.index import INDEX_NAME, write_index
from workbench.io.files.ownership import MARKER_NAME
from workbench.io.files.publish import AtomicRenamePublisher
from workbench.io.files.stream_write import StreamWriter
from workbench.io.files.writeback import WritebackWindow
from workbench.layout.layout_file import LAYOUT_FILE_NAME
from workbench.layout.model_layout import Layout
from workbench.plan.casts import check_fits
from workbench.plan.save_plan import save_dtypes

__all__ = ["ConvertResult", "dcp_to_hf"]

DCP_METADATA = ".metadata"
_CAST_ADVICE = ("convert in a dtype that holds them (dtype=None writes each tensor in its stored dtype; "
                "fp32_keys_pattern keeps the keys it matches in float32)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvertResult:
    """What ``dcp_to_hf`` wrote: the published directory, its files, key count, bytes and the loads it took."""

    path: Path
    files: tuple[str, ...]
    keys: int
    total_bytes: int
    batches: int
    largest_batch_bytes: int

    def __str__(self) -> str:
        return (f"dcp_to_hf -> {self.path}: {self.keys} keys in {len(self.files)} file(s), {self.total_bytes} bytes, "
                f"{self.batches} DCP load(s), largest batch {self.largest_batch_bytes} bytes")


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    fqn: str
    dtype: torch.dtype  # as saved in the DCP checkpoint
    keys: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # (hf_key, save dtype, key shape)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) for _, _, shape in self.keys) * self.dtype.itemsize


def dcp_to_hf(
    dcp_path: str | Path,
    hf_path: str | Path,
    layout: Layout,
    *,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    fp32_keys_pattern: Sequence[str] | str | None = None,
    budget_bytes: int = 1 << 30,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_files: Sequence[str | Path] = (),
    allow_pickle: bool = False,
) -> ConvertResult:
    """Write the parameters of a DCP checkpoint as an HF checkpoint at ``hf_path`` (one process, no group).

    Args:
        dcp_path: a directory written by ``torch.distributed.checkpoint.save`` (any planner).
        hf_path: the HF checkpoint directory to publish (replaced atomically if it exists).
        layout: names every parameter, its HF keys and fused dim (``Layout.from_model`` or ``wb.load_layout``);
            its mesh does not matter.
        prefix: what the DCP keys put before a parameter name (``"model."`` when saved as
            ``{"model": model.state_dict(), ...}``).
        dtype: the save dtype of floating keys (default: the dtype stored in the DCP checkpoint).
        fp32_keys_pattern: regexes of HF keys kept in float32 (as ``save_hf``).
        budget_bytes: bytes of full tensors assembled per DCP load (a larger tensor is loaded alone).
        max_shard_bytes: size cap of one safetensors file.
        config_files: files copied next to the weights (config.json, tokenizer files).
        allow_pickle: required: the checkpoint's ``.metadata`` (and any non-tensor entry) is a Python pickle,
            and unpickling runs code from the file. Pass True only for checkpoints whose origin you trust.

    Raises:
        CheckpointError: ``allow_pickle`` is false (nothing is read), ``dcp_path`` has no ``.metadata`` or
            it does not unpickle to DCP metadata, a parameter of the layout is missing from the DCP checkpoint,
            holds a non-tensor, or its saved global shape differs from the layout's (both named), a config
            file is missing or named like a file of the checkpoint (its index, a ``.safetensors`` file; refused
            before anything is read), or ``dtype`` cannot hold a value of a key (float32 values over 65504 into
            float16; nothing is published).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_path, hf_path = Path(dcp_path), Path(hf_path)
    metadata_file = dcp_path / DCP_METADATA
    if not metadata_file.is_file():
        raise CheckpointError(f"{dcp_path} is not a DCP checkpoint: it has no {DCP_METADATA} file")
    if not allow_pickle:
        raise CheckpointError(
            f"dcp_to_hf(allow_pickle=False): {metadata_file} is a Python pickle, and unpickling it runs whatever "
            "code the file holds, so it was not opened. If you trust where this checkpoint came from (you saved "
            "it, or its source is trusted), call dcp_to_hf(..., allow_pickle=True)"
        )
    missing_configs = [str(c) for c in config_files if not Path(c).is_file()]
    if missing_configs:
        raise CheckpointError(f"config file(s) to copy do not exist: {missing_configs}")
    clash = [str(c) for c in config_files
             if Path(c).name in (INDEX_NAME, MARKER_NAME, LAYOUT_FILE_NAME) or Path(c).name.endswith(".safetensors")]
    if clash:  # copied last, the source model's index replaced the one just written (publish then refused it)
        raise CheckpointError(f"config file(s) {clash} would overwrite the index or weight files dcp_to_hf writes; "
                              "rename them or leave them out of config_files")
    reader = dcp.FileSystemReader(str(dcp_path))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # an unpickled object of any kind, or a broken pickle: not DCP metadata
        raise CheckpointError(
            f"{metadata_file} does not hold DCP metadata: {type(exc).__name__}: {exc}"
        ) from exc
    params, problems = [], []
    for name, spec in layout.specs.items():
        fqn = prefix + name
        md = saved.get(fqn)
        if md is None:
            problems.append(f"{fqn!r}: not in the checkpoint")
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{fqn!r}: the checkpoint holds a non-tensor object")
            continue
        if tuple(md.size) != spec.global_shape:
            problems.append(f"{fqn!r}: saved global shape {tuple(md.size)}, the layout says {spec.global_shape}")
            continue
        stored = md.properties.dtype
        key_dtypes = save_dtypes(spec.hf_keys, stored, dtype=dtype, fp32_keys_pattern=fp32_keys_pattern)
        params.append(_Param(name, fqn, stored, tuple(zip(spec.hf_keys, key_dtypes, _key_shapes(spec)))))
    if problems:
        near = sorted(k for k in saved if not k.startswith(prefix))[:3]
        raise CheckpointError(
            f"the DCP checkpoint {dcp_path} does not match the layout in {len(problems)} parameter(s): "
            + "; ".join(problems[:5]) + (f" (keys outside prefix {prefix!r}, e.g. {near})" if near else "")
        )

    key_bytes = {key: math.prod(shape) * kd.itemsize for p in params for key, kd, shape in p.keys}
    order = [key for p in params for key, _, _ in p.keys]
    file_plan = plan_files(dict.fromkeys(order, 0), key_bytes, order, max_shard_bytes=max_shard_bytes)
    entries = {key: (key, kd, shape) for p in params for key, kd, shape in p.keys}
    publisher = AtomicRenamePublisher(hf_path)
    temporary = publisher.prepare()
    writers: dict[str, StreamWriter] = {}
    writeback = WritebackWindow()
    batches = largest = 0
    try:
        for spec_ in file_plan.files:
            writers[spec_.name] = StreamWriter(temporary / spec_.name, [entries[k] for k in spec_.keys],
                                               metadata={"format": "pt"}, writeback=writeback)
        for batch in _batches(params, budget_bytes):
            state = {p.fqn: torch.empty(layout.specs[p.name].global_shape, dtype=p.dtype) for p in batch}
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(dcp_path)), planner=DefaultLoadPlanner(),
                     no_dist=True)
            batches += 1
            largest = max(largest, sum(t.numel() * t.element_size() for t in state.values()))
            for p in batch:
                for key, piece in _split(layout, p, state.pop(p.fqn)):
                    writers[file_plan.weight_map[key]].write(key, piece)
        for writer in writers.values():
            writer.close()
        write_index(temporary, file_plan)
        for config in config_files:
            shutil.copy2(config, temporary / Path(config).name)
        publisher.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        publisher.abort()
        raise
    return ConvertResult(path=hf_path, files=tuple(f.name for f in file_plan.files), keys=len(order),
                         total_bytes=file_plan.total_size, batches=batches, largest_batch_bytes=largest)


def _key_shapes(spec: Any) -> list[tuple[int, ...]]:
    visible = list(spec.visible_shape)
    if spec.fused_dim is not None:
        visible[spec.fused_dim] = spec.key_size
    return [tuple(visible)] * len(spec.hf_keys)


def _batches(params: Sequence[_Param], budget_bytes: int) -> Iterator[list[_Param]]:
    batch, size = [], 0
    for p in params:
        if batch and size + p.nbytes > budget_bytes:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p.nbytes
    if batch:
        yield batch


def _split(layout: Layout, param: _Param, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    spec = layout.specs[param.name]
    for dim, size in enumerate(spec.visible_shape):
        full = full.narrow(dim, 0, size)  # FP8 tail padding is never part of the checkpoint
    for index, (key, key_dtype, _) in enumerate(param.keys):
        piece = full if spec.fused_dim is None else full.narrow(spec.fused_dim, index * spec.key_size, spec.key_size)
        # a cast into a smaller range (float32 into float16) would make large values inf, silently
        check_fits(piece, key_dtype, f"parameter {param.fqn!r} (HF key {key!r})", advice=_CAST_ADVICE)
        yield key, piece.to(key_dtype).contiguous()
