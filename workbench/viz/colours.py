"""One colour per rank, the same in every figure and HTML picture of a mesh.

Up to ``DISCRETE_LIMIT`` ranks, each rank gets a distinct qualitative colour (tab10, tab20). On larger meshes a
rank's colour is read off its mesh coordinate: the hue runs along one mesh dim (the largest; the last on a tie)
and the lightness along the others (flattened in row-major order), so neighbours along either dim differ and
the legend names both dims (``draw_key``).
"""

from __future__ import annotations

import colorsys
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.mesh import MeshSpec
from workbench.viz import _style

__all__ = ["DISCRETE_LIMIT", "RankColours", "rank_colours"]

DISCRETE_LIMIT = 20  # up to this many ranks, each gets a distinct qualitative colour
_HUE_SPAN = 0.85  # hues from red through violet, stopping short of red again
_LIGHT = (0.30, 0.72)  # HLS lightness from the first to the last index of the lightness dims
_SATURATION = 0.80
_KEY_LABEL_PT = 72.0  # longest line of the key's lightness label (the key can be this short)


@dataclass(frozen=True, eq=False)
class RankColours:
    """Colours of every rank of ``mesh``: ``colours(rank)`` is an RGBA tuple.

    Attributes:
        mesh: the mesh.
        hue_dim: index of the mesh dim the hue runs along (None: discrete colours per rank).
        light_dims: indices of the mesh dims the lightness runs along (row-major), possibly empty.
        table: RGBA of every rank.
    """

    mesh: MeshSpec
    hue_dim: int | None
    light_dims: tuple[int, ...]
    table: dict[int, tuple[float, float, float, float]]

    @property
    def discrete(self) -> bool:
        """True when every rank has its own qualitative colour (small meshes)."""
        return self.hue_dim is None

    def __call__(self, rank: int) -> tuple[float, float, float, float]:
        return self.table[rank]

    def hex(self, rank: int) -> str:
        """``#rrggbb`` of the rank (``#eeeeee`` for -1: nobody)."""
        if rank < 0:
            return "#eeeeee"
        return "#" + "".join(f"{round(255 * c):02x}" for c in self.table[rank][:3])

    def describe(self) -> str:
        """One line saying how colours map to ranks."""
        if self.discrete:
            return "one colour per rank"
        names = self.mesh.dim_names
        hue = f"hue: {names[self.hue_dim]} (0-{self.mesh.shape[self.hue_dim] - 1})"
        if not self.light_dims:
            return hue
        light = " x ".join(names[d] for d in self.light_dims)
        levels = int(np.prod([self.mesh.shape[d] for d in self.light_dims]))
        return f"{hue}, lightness: {light} (0-{levels - 1}, dark to light)"

    def key_image(self) -> np.ndarray:
        """The colour key: an ``(lightness levels, hue levels, 4)`` RGBA array (rows: lightness index)."""
        hue_n = self.mesh.shape[self.hue_dim] if self.hue_dim is not None else 1
        light_n = int(np.prod([self.mesh.shape[d] for d in self.light_dims])) if self.light_dims else 1
        return np.array([[_hls(h, hue_n, v, light_n) for h in range(hue_n)] for v in range(light_n)])

    def draw_key(self, ax: Any) -> None:
        """Draw the legend into ``ax``: a patch per rank (small meshes) or the hue x lightness grid, dims named."""
        names = self.mesh.dim_names
        if self.discrete:
            from matplotlib.patches import Patch

            handles = [Patch(facecolor=self(r), label=f"rank {r}") for r in self.mesh.all_ranks()]
            ax.set_axis_off()
            ax.legend(handles=handles, loc="upper left", fontsize=_style.MIN_PT, frameon=False,
                      ncols=1 if len(handles) <= 10 else 2, borderaxespad=0, handlelength=1.2)
            return
        image = self.key_image()
        ax.imshow(image, aspect="auto", interpolation="nearest", origin="upper")
        ax.set_box_aspect(min(2.0, max(0.6, 1.6 * image.shape[0] / image.shape[1] + 0.6)))
        ax.set_anchor("N")
        ax.set_xlabel(f"hue:\n{names[self.hue_dim]}", fontsize=_style.MIN_PT)
        hue_n = image.shape[1]
        ax.set_xticks([0, hue_n - 1], ["0", str(hue_n - 1)], fontsize=_style.MIN_PT)
        if self.light_dims:
            light_n = image.shape[0]
            parts = ["lightness:", *(names[d] for d in self.light_dims)]  # lines that fit beside a short key
            label = _style.wrap_parts(parts, " x ", _KEY_LABEL_PT).replace("lightness: x", "lightness:")
            ax.set_ylabel(label, fontsize=_style.MIN_PT)
            ax.set_yticks([0, light_n - 1], ["0", str(light_n - 1)], fontsize=_style.MIN_PT)
        else:
            ax.set_yticks([])


def _hls(h: int, hue_n: int, v: int, light_n: int) -> tuple[float, float, float, float]:
    hue = _HUE_SPAN * h / max(hue_n - 1, 1)
    light = _LIGHT[0] + (_LIGHT[1] - _LIGHT[0]) * (v / max(light_n - 1, 1) if light_n > 1 else 0.5)
    r, g, b = colorsys.hls_to_rgb(hue, light, _SATURATION)
    return (r, g, b, 1.0)


@functools.lru_cache(maxsize=32)
def rank_colours(mesh: MeshSpec) -> RankColours:
    """The colours of ``mesh``'s ranks (cached per mesh)."""
    mpl = _style.matplotlib()
    size = mesh.size
    if size <= DISCRETE_LIMIT:
        cmap = mpl.colormaps["tab10" if size <= 10 else "tab20"]
        table = {r: tuple(float(c) for c in cmap(i % cmap.N)) for i, r in enumerate(mesh.all_ranks())}
        return RankColours(mesh, None, (), table)
    shape = mesh.shape
    hue_dim = max(range(len(shape)), key=lambda d: (shape[d], d))
    light_dims = tuple(d for d in range(len(shape)) if d != hue_dim and shape[d] > 1)
    light_n = int(np.prod([shape[d] for d in light_dims])) if light_dims else 1
    table = {}
    for rank in mesh.all_ranks():
        coord = mesh.coordinate(rank)
        v = int(np.ravel_multi_index([coord[d] for d in light_dims], [shape[d] for d in light_dims])) \
            if light_dims else 0
        table[rank] = _hls(coord[hue_dim], shape[hue_dim], v, light_n)
    return RankColours(mesh, hue_dim, light_dims, table)
