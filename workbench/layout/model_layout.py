"""Layout: a mesh plus the LoadSpec (and dtype) of every parameter of a model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from workbench.errors import LayoutError
from workbench.layout.coverage import CoverageReport
from workbench.layout.load_spec import LoadSpec
from workbench.mesh import MeshSpec

__all__ = ["Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Every parameter's LoadSpec on one mesh, in model order, with its runtime dtype.

    Args:
        mesh: the device mesh every spec refers to.
        specs: ``{parameter name: LoadSpec}`` in model (state-dict) order.
        dtypes: ``{parameter name: dtype name}``, e.g. ``"bfloat16"``; missing names default to float32.
        name: a label for reports (the file it came from, the model family).
    """

    mesh: MeshSpec
    specs: Mapping[str, LoadSpec]
    dtypes: Mapping[str, str] = field(default_factory=dict)
    name: str = "layout"

    def __post_init__(self) -> None:
        specs = dict(self.specs)
        owner: dict[str, str] = {}
        for name, spec in specs.items():
            if spec.name != name:
                raise LayoutError(f"Layout: spec stored under {name!r} is named {spec.name!r}")
            if spec.mesh != self.mesh:
                raise LayoutError(f"Layout: parameter {name!r} is on {spec.mesh!r}, the layout on {self.mesh!r}")
            for key in spec.hf_keys:
                if key in owner:
                    raise LayoutError(f"Layout: HF key {key!r} belongs to both {owner[key]!r} and {name!r}")
                owner[key] = name
        dtypes = {k: str(v).removeprefix("torch.") for k, v in dict(self.dtypes).items()}
        for name, dtype in dtypes.items():
            if name not in specs:
                raise LayoutError(f"Layout: dtype given for unknown parameter {name!r}")
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise LayoutError(f"Layout: parameter {name!r} has unknown dtype {dtype!r}")
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "dtypes", dtypes)

    def __getitem__(self, name: str) -> LoadSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r} in {self!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def dtype(self, name: str) -> torch.dtype:
        """Runtime dtype of a parameter (float32 when the layout does not say)."""
        return getattr(torch, self.dtypes.get(name, "float32"))

    @property
    def hf_keys(self) -> dict[str, str]:
        """``{hf_key: parameter name}`` over the whole layout, in model order."""
        return {key: name for name, spec in self.specs.items() for key in spec.hf_keys}

    def coverage(self) -> dict[str, CoverageReport]:
        """Coverage verdict of every parameter (computed once per distinct geometry)."""
        seen: dict[tuple, CoverageReport] = {}
        out = {}
        for name, spec in self.specs.items():
            geometry = (spec.global_shape, spec.shards)
            if geometry not in seen:
                seen[geometry] = spec.coverage()
            report = seen[geometry]
            out[name] = report if report.name == name else _renamed(report, name)
        return out

    def __repr__(self) -> str:
        keys = sum(len(s.hf_keys) for s in self.specs.values())
        return f"Layout({self.name!r}, mesh={self.mesh!r}, params={len(self.specs)}, hf_keys={keys})"


def _renamed(report: CoverageReport, name: str) -> CoverageReport:
    from dataclasses import replace

    return replace(report, name=name)
