"""``explore(layout)``: an ipywidgets app to browse a layout: parameter or HF key, rank, save policy, budget.

Standard widgets only (Dropdown, IntSlider, Image, HTML, boxes), so it works in JupyterLab, classic Notebook
and VS Code. Figures are rendered to PNG into ``Image`` widgets. Everything slow is cached: a parameter's
shard view and base figures are drawn once and a rank change only moves the outlines; schedules are planned
once per (policy, budget) for every rank (ranks of one shape class share one), or per rank for policies whose
plans depend on each rank's keys.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.layout.model_layout import Layout
from workbench.viz import _style

__all__ = ["Explorer", "explore"]

_BUDGETS = ("unbounded", "1/64", "1/16", "1/4", "1/2")  # fractions of the largest tensor's gathered bytes
_DPI = 72


def explore(layout: Layout, *, param: str | None = None, rank: int = 0) -> Any:
    """An ipywidgets app over ``layout``; returns the top ``Widget`` (its ``.explorer`` drives it from code).

    Pick a parameter (and optionally one of its HF keys), slide a rank or its mesh coordinates, choose a save
    policy and a memory budget: the shard offsets, the mesh (elements each rank holds, the rank's group
    outlined), the rank's unshard schedule and the bytes-per-rank heat map of the whole layout update together.
    """
    return Explorer(layout, param=param, rank=rank).widget


class Explorer:
    """State and widgets of ``explore``; ``update_seconds`` is how long the last refresh took."""

    def __init__(self, layout: Layout, *, param: str | None = None, rank: int = 0) -> None:
        try:
            import ipywidgets as w
        except ImportError as exc:  # pragma: no cover - ipywidgets is a dependency
            raise ImportError("workbench.viz.explore needs ipywidgets: pip install ipywidgets") from exc
        self.layout = layout
        mesh = layout.mesh
        names = list(layout.specs)
        if param is None:
            param = max(names, key=lambda n: math.prod(layout.specs[n].global_shape))
        self._views: dict[tuple, Any] = {}
        self._schedules: dict[tuple, Any] = {}
        self._schedule_png: dict[tuple, bytes] = {}
        self._heat_values: np.ndarray | None = None
        self.update_seconds = 0.0
        self._busy = False

        self.param = w.Dropdown(options=names, value=param, description="parameter",
                                layout=w.Layout(width="520px"))
        self.key = w.Dropdown(options=self._key_options(param), value="(whole tensor)", description="HF key",
                              layout=w.Layout(width="520px"))
        self.rank = w.IntSlider(value=rank, min=0, max=mesh.size - 1, description="rank", continuous_update=False,
                                layout=w.Layout(width="520px"))
        self.coords = [
            w.IntSlider(value=c, min=0, max=s - 1, description=n, continuous_update=False,
                        layout=w.Layout(width="250px"))
            for n, s, c in zip(mesh.dim_names, mesh.shape, mesh.coordinate(rank))
        ]
        self.group = w.Dropdown(options=["(rank only)", *mesh.dim_names], value="(rank only)",
                                description="group along")
        refs = [f"preserve({n})" for n in mesh.dim_names]
        self.policy = w.Dropdown(options=["full", "minimal", *refs], value="full", description="policy")
        self.budget = w.Dropdown(options=list(_BUDGETS), value="unbounded", description="budget")
        self.offsets = w.Image(format="png")
        self.mesh_image = w.Image(format="png")
        self.schedule_image = w.Image(format="png")
        self.heat = w.Image(format="png")
        self.info = w.HTML()
        self.status = w.HTML()

        self.param.observe(self._on_param, names="value")
        self.key.observe(lambda _: self.refresh(), names="value")
        self.rank.observe(self._on_rank, names="value")
        for slider in self.coords:
            slider.observe(self._on_coord, names="value")
        self.group.observe(lambda _: self.refresh(), names="value")
        self.policy.observe(lambda _: self.refresh(), names="value")
        self.budget.observe(lambda _: self.refresh(), names="value")

        controls = w.VBox([
            w.HTML(f"<b>{layout.name}</b>: {mesh!r}, {len(layout)} parameters, {len(layout.hf_keys)} HF keys"),
            self.param, self.key, self.rank, w.HBox(self.coords, layout=w.Layout(flex_flow="row wrap")),
            w.HBox([self.group, self.policy, self.budget], layout=w.Layout(flex_flow="row wrap")), self.info,
        ])
        left = w.VBox([w.HTML("<b>shard offsets</b>"), self.offsets])
        right = w.VBox([w.HTML("<b>mesh</b> (elements of the parameter held)"), self.mesh_image,
                        w.HTML("<b>bytes per rank</b>, whole layout"), self.heat])
        self.widget = w.VBox([controls, w.HBox([left, right], layout=w.Layout(flex_flow="row wrap")),
                              w.HTML("<b>unshard schedule</b> of the rank"), self.schedule_image, self.status])
        self.widget.explorer = self
        self.widget.add_class("workbench-explorer")
        self.refresh()

    # -- events ------------------------------------------------------------------------------------------
    def _on_param(self, change: Any) -> None:
        self._busy = True
        try:
            self.key.options = self._key_options(change["new"])
            self.key.value = "(whole tensor)"
        finally:
            self._busy = False
        self.refresh()

    def _on_rank(self, change: Any) -> None:
        self._busy = True
        try:
            for slider, c in zip(self.coords, self.layout.mesh.coordinate(change["new"])):
                slider.value = c
        finally:
            self._busy = False
        self.refresh()

    def _on_coord(self, _: Any) -> None:
        if self._busy:
            return
        self.rank.value = self.layout.mesh.rank_at([s.value for s in self.coords])

    def _key_options(self, param: str) -> list[str]:
        keys = self.layout.specs[param].hf_keys
        return ["(whole tensor)", *keys] if len(keys) > 1 else ["(whole tensor)"]

    # -- drawing -----------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw every view for the current controls (called on every change)."""
        if self._busy:
            return
        start = time.perf_counter()
        rank = self.rank.value
        name = self.param.value
        spec = self.layout.specs[name]
        key = None if self.key.value == "(whole tensor)" else self.key.value
        offsets = self._offsets_figure(name, key)
        mine = [b for b in offsets.fig.view.boxes if b.rank == rank]
        self.offsets.value = offsets.png({0: [(b.col0, b.row0, b.col1 - b.col0, b.row1 - b.row0) for b in mine]})
        group = (rank,) if self.group.value == "(rank only)" else self.layout.mesh.group_ranks(rank, self.group.value)
        self.mesh_image.value = self._mesh_figure(name).png(_mesh_cells(self.layout.mesh, group))
        if not self.heat.value:  # the whole layout's bytes per rank do not depend on the controls
            self.heat.value = _png(self._heat_figure())
        schedule = self._schedule(rank)
        self.schedule_image.value = self._schedule_picture(schedule)
        coord = ", ".join(f"{n}={c}" for n, c in zip(self.layout.mesh.dim_names, self.layout.mesh.coordinate(rank)))
        regions = spec.key_regions(rank)
        shown = "<br>".join(str(r) for r in regions[:6]) + (f"<br>... {len(regions) - 6} more" if len(regions) > 6
                                                            else "")
        self.info.value = (
            f"<code>rank {rank} ({coord}): local {spec.local_shape(rank)} of {spec.global_shape}, "
            f"{spec.describe_shards()}<br>{shown or 'holds no HF key region'}</code>"
        )
        self.update_seconds = time.perf_counter() - start
        self.status.value = (
            f"<small>schedule: {schedule.num_calls} call(s), predicted peak "
            f"{_style.format_bytes(schedule.peak_bytes)}; updated in {self.update_seconds * 1000:.0f} ms</small>"
        )

    def _offsets_figure(self, name: str, key: str | None) -> Any:
        cache = ("offsets", name, key)
        fig = self._views.get(cache)
        if fig is None:
            from workbench.viz.figures import plot_shard_offsets

            fig = _Blitted(plot_shard_offsets(self.layout.specs[name], key=key, figsize=(6.0, 4.0)))
            self._views[cache] = fig
        return fig

    def _mesh_figure(self, name: str) -> Any:
        cache = ("mesh", name)
        fig = self._views.get(cache)
        if fig is None:
            from workbench.viz.figures import plot_mesh

            fig = _Blitted(plot_mesh(self.layout.mesh, self.layout.specs[name], figsize=(5.0, 3.2)))
            self._views[cache] = fig
        return fig

    def _heat_figure(self) -> Any:
        fig = self._views.get(("heat",))
        if fig is None:
            from workbench.viz.html import _layout_bytes_per_rank

            values = _layout_bytes_per_rank(self.layout)
            self._heat_values = values
            fig = _heat(self.layout, values)
            self._views[("heat",)] = fig
        return fig

    def _budget_bytes(self) -> int | None:
        if self.budget.value == "unbounded":
            return None
        fraction = 1 / int(self.budget.value.split("/")[1])
        largest = max(math.prod(s.global_shape) * self.layout.dtype(n).itemsize for n, s in self.layout.specs.items())
        return max(1, int(largest * fraction))

    def _policy(self) -> Any:
        from workbench.plan.policy import SavePolicy

        value = self.policy.value
        if value.startswith("preserve("):
            return SavePolicy.preserve(value[len("preserve("):-1])
        return SavePolicy.full() if value == "full" else SavePolicy.minimal()

    def _schedule(self, rank: int) -> Any:
        """The rank's schedule under the chosen policy and budget (cached)."""
        policy, budget = self._policy(), self._budget_bytes()
        world_key = (str(policy), budget)
        if policy.mode in ("full", "gather_only"):
            schedules = self._schedules.get(world_key)
            if schedules is None:  # every rank at once: ranks of one shape class share a schedule
                from workbench.run.simulated import plan_save

                schedules = plan_save(self.layout, policy=policy, budget_bytes=budget).schedules
                self._schedules[world_key] = schedules
            return schedules[rank]
        cache = (*world_key, rank)
        schedule = self._schedules.get(cache)
        if schedule is None:
            from workbench.plan.save_plan import plan_hf_save
            from workbench.plan.schedule import schedule_unshard

            runtime = {n: self.layout.dtype(n) for n in self.layout}
            plans = [plan_hf_save(s, rank, policy, runtime_dtype=runtime[n]) for n, s in self.layout.specs.items()]
            schedule = schedule_unshard(plans, runtime, budget)
            self._schedules[cache] = schedule
        return schedule

    def _schedule_picture(self, schedule: Any) -> bytes:
        cache = (id(schedule.calls), schedule.peak_bytes)  # ranks of one shape class share their calls
        png = self._schedule_png.get(cache)
        if png is None:
            from workbench.viz.figures import plot_schedule

            fig = plot_schedule(schedule, figsize=(9.0, 3.6))
            title = fig.axes[0].get_title()
            fig.axes[0].set_title(title.split(": ", 1)[-1] + "  (every rank of this shape class)", fontsize=9)
            png = _png(fig)
            if len(self._schedule_png) > 64:
                self._schedule_png.clear()
            self._schedule_png[cache] = png
        return png


# -- helpers --------------------------------------------------------------------------------------------
def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI)
    return buffer.getvalue()


class _Blitted:
    """A figure drawn once; each update restores its pixels and draws only the outlines (tens of ms, not
    hundreds: ticks and text are never drawn again)."""

    def __init__(self, fig: Any) -> None:
        fig.set_dpi(_DPI)
        fig.canvas.draw()
        self.fig = fig
        self.axes = [a for a in fig.axes if a.get_label() != "<colorbar>"]
        self.background = fig.canvas.copy_from_bbox(fig.bbox)

    def png(self, boxes: dict[int, Sequence[tuple[float, float, float, float]]]) -> bytes:
        """PNG of the figure with black outlines ``(x, y, width, height)`` on axes ``n`` for each ``n: boxes``."""
        from matplotlib.patches import Rectangle
        from PIL import Image

        canvas = self.fig.canvas
        canvas.restore_region(self.background)
        for n, rects in boxes.items():
            ax = self.axes[n]
            for x, y, width, height in rects:
                patch = Rectangle((x, y), width, height, fill=False, edgecolor="black", linewidth=2.2)
                patch.set_clip_path(ax.patch)
                ax.add_patch(patch)
                ax.draw_artist(patch)
                patch.remove()
        buffer = io.BytesIO()
        Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1).save(
            buffer, format="png", compress_level=1)
        return buffer.getvalue()


def _mesh_cells(mesh: Any, ranks: Sequence[int]) -> dict[int, list[tuple[float, float, float, float]]]:
    """Per panel of a ``plot_mesh`` figure, the cell ``(x, y, 1, 1)`` of each of ``ranks``."""
    out: dict[int, list[tuple[float, float, float, float]]] = {}
    for rank in ranks:
        coord = mesh.coordinate(rank)
        if mesh.ndim == 1:
            panel, i, j = 0, 0, coord[0]
        else:
            lead = coord[:-2]
            panel = int(np.ravel_multi_index(lead, mesh.shape[:-2])) if lead else 0
            i, j = coord[-2], coord[-1]
        out.setdefault(panel, []).append((j, i, 1, 1))
    return out


def _heat(layout: Layout, values: np.ndarray) -> Any:
    """Bytes per rank over the mesh (one panel per leading coordinate), with a colour bar."""
    mesh = layout.mesh
    fig = _style.new_figure((5.0, 2.6))
    grid = values.reshape(mesh.shape)
    panels = [grid.reshape(1, -1)] if mesh.ndim == 1 else [grid[lead] for lead in np.ndindex(*mesh.shape[:-2])]
    ncols = min(len(panels), 4)
    nrows = -(-len(panels) // ncols)
    image = None
    for n, panel in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, n + 1)
        image = ax.pcolormesh(panel, cmap=_style.heat_cmap(), vmin=0, vmax=max(values.max(), 1))
        ax.set_xlim(0, panel.shape[1])
        ax.set_ylim(panel.shape[0], 0)
        for axis, size in ((ax.xaxis, panel.shape[1]), (ax.yaxis, panel.shape[0])):
            step = max(1, size // 8)
            axis.set_ticks(np.arange(0, size, step) + 0.5, [str(i) for i in range(0, size, step)])
        ax.set_xlabel(mesh.dim_names[-1], fontsize=6)
        if mesh.ndim > 1:
            ax.set_ylabel(mesh.dim_names[-2], fontsize=6)
        ax.tick_params(labelsize=6)
    bar = fig.colorbar(image, ax=fig.axes, fraction=0.05)
    bar.ax.set_label("<colorbar>")
    bar.ax.yaxis.set_major_formatter(_style.bytes_formatter())
    bar.ax.tick_params(labelsize=6)
    fig.suptitle(f"bytes per rank: {_style.format_bytes(values.min())} .. {_style.format_bytes(values.max())}",
                 fontsize=8)
    return fig
