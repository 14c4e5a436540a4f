"""``explore(layout)``: an ipywidgets app to browse a layout: parameter or HF key, rank, save policy, budget.

Standard widgets only (Combobox, sliders, Dropdown, Image, HTML, boxes), so it works in JupyterLab, classic
Notebook and VS Code. Figures are PNGs rendered at twice their CSS size (sharp on hi-dpi screens) into
``Image`` widgets of that CSS width. A rank change sends one message: each view's static part is drawn and sent
once per parameter, and what the rank adds to them (its text, the overview's outline and zoom window, the zoom
panel's boxes and labels, the mesh's outlines) is one HTML value of inline SVGs laid over the pictures
(``workbench.viz.stage``). Pictures of the last ranks are kept, and those one step away on the rank or a
coordinate slider are drawn ahead in a background thread while nobody moves a control.
Schedules are planned once per (policy, budget) for every rank where ranks of one shape class share one (drawn
once per class, in the background right after the explorer opens), or per rank in the background for policies
whose plans depend on each rank's keys; a rank change never waits for them.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import gc
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from workbench.errors import LayoutError, PlanError
from workbench.layout.model_layout import Layout
from workbench.units import format_ranks
from workbench.viz import _style

__all__ = ["Explorer", "explore"]

_BUDGETS = ("unbounded", "1/64", "1/16", "1/4", "1/2")  # fractions of the largest tensor's gathered bytes
_WHOLE = "(whole tensor)"
_SCALE = _style.HIDPI  # PNG pixels per CSS pixel
# pictures kept, least recently shown leave first: the offsets and mesh pictures of about the last 8 parameters
# (each ~14 MiB on DeepSeek-V3: canvases at twice their size, PNGs, marks), so going back a few is instant
_KEEP_PICTURES = 16
# once, in the title (a <style> in the per-rank value would restyle the page on every change): the overlay lets
# clicks through to the pictures under it, except on its text
_OVERLAY_STYLE = ("<style>.workbench-rank{pointer-events:none}.workbench-rank .wb-text{pointer-events:auto;"
                  "line-height:1.5}</style>")


def explore(layout: Layout, *, param: str | None = None, rank: int | None = None, background: bool = True) -> Any:
    """An ipywidgets app over ``layout``; returns the top ``Widget`` (its ``.explorer`` drives it from code).

    Pick a parameter (and optionally one of its HF keys; type to filter either list), slide a rank or its
    mesh coordinates, choose a save policy and a memory budget: the shard offsets (zoomed on the rank when its
    part is thin), the mesh (elements each rank holds, the rank's group outlined), the rank's unshard schedule
    and the bytes-per-rank heat map of the whole layout update together. ``rank`` defaults to the mesh's first
    rank (a pipeline stage's sub-mesh may hold ranks 4..7). ``background=False`` plans and draws schedules at
    once instead of in a background thread (scripts, tests).
    """
    return Explorer(layout, param=param, rank=rank, background=background).widget


class Explorer:
    """State and widgets of ``explore``; ``update_seconds`` is how long the last refresh took (schedules
    planned or drawn in the background not included: ``settle()`` waits for them)."""

    def __init__(self, layout: Layout, *, param: str | None = None, rank: int | None = None,
                 background: bool = True) -> None:
        try:
            import ipywidgets as w
        except ImportError as exc:  # pragma: no cover - ipywidgets is a dependency
            raise ImportError("workbench.viz.explore needs ipywidgets: pip install ipywidgets") from exc
        self.layout = layout
        mesh = layout.mesh
        names = list(layout.specs)
        if not names:
            raise ValueError(f"explore: {layout!r} has no parameters")
        if param is None:
            param = max(names, key=lambda n: math.prod(layout.specs[n].global_shape))
        elif param not in layout.specs:
            raise ValueError(f"explore: {param!r} is not a parameter of {layout!r}")
        rank = _start_rank(mesh, rank)  # a clear error for a rank outside the mesh
        self._ranks = sorted(mesh.all_ranks())  # the rank slider's stops, in order
        self._pictures: OrderedDict[tuple, Any] = OrderedDict()  # least recently shown first
        self._schedules: dict[tuple, Any] = {}
        self._schedule_png: dict[tuple, bytes] = {}
        # why a (policy, budget, rank) cannot be planned: its text only (an exception's traceback keeps the
        # planner's frames alive), so a rank change does not plan it again
        self._plan_errors: dict[tuple, str] = {}
        self.update_seconds = 0.0
        self._busy = False
        self._param_value = param
        self._key_value: str | None = None
        self._worker = _Worker(self._quiet_for) if background else None
        self._last_refresh = 0.0
        self._generation = 0  # refreshes started
        self._ahead_from = rank  # the rank the last drawing ahead was around

        wide = w.Layout(width="560px")
        self.param = w.Combobox(options=names, value=param, description="parameter", ensure_option=True,
                                placeholder=f"type to filter {len(names)} parameters", layout=wide)
        self.key = w.Combobox(options=self._key_options(param), value=_WHOLE, description="HF key",
                              ensure_option=True, placeholder="type to filter the HF keys", layout=wide)
        self.rank = _rank_slider(w, self._ranks, rank, wide)
        self.coords = [
            w.IntSlider(value=c, min=0, max=s - 1, description=n, continuous_update=False,
                        layout=w.Layout(width="270px"))
            for n, s, c in zip(mesh.dim_names, mesh.shape, mesh.coordinate(rank))
        ]
        self.group = w.Dropdown(options=["(rank only)", *mesh.dim_names], value="(rank only)",
                                description="group along")
        refs = [f"preserve({n})" for n in mesh.dim_names]
        self.policy = w.Dropdown(options=["full", "minimal", *refs], value="full", description="policy")
        self.budget = w.Dropdown(options=list(_BUDGETS), value="unbounded", description="budget")
        # static PNGs (drawn once per parameter) on a grid, and over them one HTML value: what the chosen rank
        # adds (its text, and the SVG marks of each picture: outlines, the zoom window, the zoom's boxes and labels)
        flat = w.Layout(margin="0")  # the overlay's positions count from the grid's tracks
        self.offsets = w.Image(format="png", layout=flat)
        self.zoom_image = w.Image(format="png", layout=w.Layout(margin="0"))  # the zoom panel's frame
        self.mesh_image = w.Image(format="png", layout=w.Layout(margin="0"))
        self.rank_view = w.HTML(layout=w.Layout(margin="0"))
        self.marks: dict[str, bytes] = {}  # the SVG marks shown over each picture, by picture
        self.schedule_image = w.Image(format="png")
        self.heat = w.Image(format="png")
        for widget, role in ((self.offsets, "offsets"), (self.zoom_image, "zoom"), (self.mesh_image, "mesh"),
                             (self.rank_view, "rank"), (self.schedule_image, "schedule"), (self.heat, "heat")):
            widget.add_class(f"workbench-{role}")  # names each part in the page (browser tests, styling)
        self.message = w.HTML()
        self.schedule_note = w.HTML()
        self.progress = w.HTML()

        self.param.observe(self._on_param, names="value")
        self.key.observe(self._on_key, names="value")
        self.rank.observe(self._on_rank, names="value")
        for slider in self.coords:
            slider.observe(self._on_coord, names="value")
        self.group.observe(lambda _: self.refresh(), names="value")
        self.policy.observe(lambda _: self.refresh(), names="value")
        self.budget.observe(lambda _: self.refresh(), names="value")

        controls = w.VBox([
            w.HTML(f"<b>{_escape(str(layout.name))}</b>: {_escape(repr(mesh))}, {len(layout)} parameters, "
                   f"{len(layout.hf_keys)} HF keys" + _OVERLAY_STYLE),
            self.param, self.key, self.rank, w.HBox(self.coords, layout=w.Layout(flex_flow="row wrap")),
            w.HBox([self.group, self.policy, self.budget], layout=w.Layout(flex_flow="row wrap")),
            self.message,
        ])
        self.pictures = w.GridBox([self.offsets, self.zoom_image, self.mesh_image, self.rank_view],
                                  layout=w.Layout(overflow="visible"))
        self._stage: Any = None
        self.widget = w.VBox([controls, self.pictures, w.HTML("<b>bytes per rank</b>, whole layout"), self.heat,
                              w.HTML("<b>unshard schedule</b> of the rank"), self.schedule_note,
                              self.schedule_image, self.progress])
        self.widget.explorer = self
        self.widget.add_class("workbench-explorer")
        self._set_image(self.heat, self._heat_png())
        if self._worker is not None:
            # plan every rank's schedule of the default policy now (ranks of one shape class share one); their
            # pictures, one per class, are drawn in the background while nobody moves a control
            classes = self._classes("full", "unbounded")
        self.refresh()
        # a full garbage collection now, not in the middle of a rank change: building made many objects, and
        # the collector's next full pass over them (~150 ms on DeepSeek-V3) would land on an update
        gc.collect()
        if self._worker is not None:
            self.progress.value = f"<small>drawing the schedules of {len(classes)} shape class(es) ahead ...</small>"
            for n, schedule in enumerate(classes, 1):
                self._worker.submit(("precompute", _class_key(schedule)),
                                    lambda schedule=schedule: self._schedule_picture(schedule),
                                    lambda _, n=n: self._drawn_ahead(n, len(classes)))

    # -- events ------------------------------------------------------------------------------------------
    def _on_param(self, change: Any) -> None:
        name = change["new"]
        if name not in self.layout.specs:  # typed text that names no parameter (yet)
            self.message.value = _warn(f"no parameter is named {name!r}; pick one from the list")
            return
        self._param_value = name
        self._busy = True
        try:
            self.key.options = self._key_options(name)
            self.key.value = _WHOLE
        finally:
            self._busy = False
        self.refresh()

    def _on_key(self, change: Any) -> None:
        if self._busy:
            return
        if change["new"] not in self.key.options:
            self.message.value = _warn(f"{change['new']!r} is not an HF key of {self._param_value}")
            return
        self.refresh()

    def _on_rank(self, change: Any) -> None:
        self.refresh()  # the pictures before the coordinate sliders follow (their messages would go first)
        self._busy = True
        try:
            for slider, c in zip(self.coords, self.layout.mesh.coordinate(change["new"])):
                slider.value = c
        finally:
            self._busy = False

    def _on_coord(self, _: Any) -> None:
        if self._busy:
            return
        self.rank.value = self.layout.mesh.rank_at([s.value for s in self.coords])

    def _key_options(self, param: str) -> list[str]:
        keys = self.layout.specs[param].hf_keys
        return [_WHOLE, *keys] if len(keys) > 1 else [_WHOLE]

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until schedules planned or drawn in the background are shown."""
        if self._worker is not None:
            self._worker.settle(timeout)

    # -- drawing -----------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw every view for the current controls (called on every change)."""
        if self._busy:
            return
        start = time.perf_counter()
        self._generation += 1  # drawing ahead for an earlier rank stops at its next step
        rank = self.rank.value
        name = self._param_value
        spec = self.layout.specs[name]
        key = None if self.key.value in (_WHOLE, "") or self.key.value not in spec.hf_keys else self.key.value
        # the static pictures change only with the parameter (no message otherwise); a rank change sends one
        # message: the rank's text and every picture's SVG marks, as one HTML value over them. A scalar (0-d) has
        # no offsets to draw: only its mesh picture, and a note
        offsets = self._offsets_picture(name, key) if spec.global_shape else None
        mesh = self._mesh_picture(name)
        self._set_stage(offsets, mesh)
        marks = {"mesh": mesh.marks(self._group(rank))}
        if offsets is not None:
            marks["offsets"] = offsets.marks(rank)
            if offsets.zoomed:
                marks["zoom"] = offsets.zoom(rank)
        self.marks = marks
        self._show_schedule(rank)
        info = self._rank_text(rank, name, key)
        # a warning about typed text is answered (no message when there was none)
        self.message.value = "" if offsets is not None else _note(
            f"{name} is a scalar (0-d): no offsets to draw; held whole by {self.layout.mesh.size} ranks")
        self._last_refresh = time.perf_counter()
        self.update_seconds = self._last_refresh - start
        text = f"{info}<br><small>updated in {self.update_seconds * 1000:.0f} ms</small>"
        self.rank_view.value = self._stage.overlay(text, marks, rank=rank)
        self._draw_ahead(offsets, mesh, rank)

    def _rank_text(self, rank: int, name: str, key: str | None) -> str:
        """The rank's text (HTML, every name escaped): its coordinate, local shape and key regions."""
        mesh, spec = self.layout.mesh, self.layout.specs[name]
        coord = ", ".join(f"{n}={c}" for n, c in zip(mesh.dim_names, mesh.coordinate(rank)))
        regions = [r for r in spec.key_regions(rank) if key is None or r.hf_key == key]
        shown = "<br>".join(_escape(str(r)) for r in regions[:6])
        if len(regions) > 6:
            shown += f"<br>... {len(regions) - 6} more"
        warning = "" if regions else _warn(f"rank {rank} holds none of {key or name}")
        return (f"{warning}<code>rank {rank} ({_escape(coord)}): local {spec.local_shape(rank)} of "
                f"{spec.global_shape}, {_escape(spec.describe_shards())}<br>{shown or 'holds no HF key region here'}"
                "</code>")

    def _group(self, rank: int) -> tuple[int, ...]:
        """The ranks the mesh view outlines for ``rank``: itself, or its group along the chosen mesh dim."""
        if self.group.value == "(rank only)":
            return (rank,)
        return tuple(self.layout.mesh.group_ranks(rank, self.group.value))

    def _draw_ahead(self, offsets: Any, mesh: Any, rank: int) -> None:
        """Draw, in the background once nobody moves a control, the ranks one step away on the rank slider (the
        way it last went first) and on each coordinate slider: where a person goes next. Dropped at the next
        step as soon as a control moves."""
        if self._worker is None:
            return
        mesh_spec = self.layout.mesh
        coord = list(mesh_spec.coordinate(rank))
        step = -1 if rank < self._ahead_from else 1  # the way the slider went first, then back
        self._ahead_from = rank
        near = [self._slider_step(rank, step), self._slider_step(rank, -step)]
        for d, size in enumerate(mesh_spec.shape):
            for step in (1, -1):
                if 0 <= coord[d] + step < size:
                    near.append(mesh_spec.rank_at([*coord[:d], coord[d] + step, *coord[d + 1:]]))
        near = [r for r in dict.fromkeys(near) if r is not None and r != rank]
        generation = self._generation

        def dropped() -> bool:  # the controls moved on: a newer request draws around the new rank
            return self._generation != generation or _STOPPING.is_set()

        steps: list[Callable[[], Any]] = []
        for r in near:
            if offsets is not None and offsets.zoomed:
                steps.append(lambda r=r: offsets.zoom(r, dropped))
            if offsets is not None:
                steps.append(lambda r=r: offsets.marks(r, dropped))
            group = self._group(r)
            steps.append(lambda group=group: mesh.marks(group))

        def work() -> None:
            for step in steps:
                if dropped():
                    return
                try:
                    step()
                except _Dropped:
                    return

        self._worker.submit(("ahead",), work, None)

    def _slider_step(self, rank: int, step: int) -> int | None:
        """The rank ``step`` stops from ``rank`` on the rank slider (None past its ends)."""
        i = bisect.bisect_left(self._ranks, rank) + step
        return self._ranks[i] if 0 <= i < len(self._ranks) else None

    def _set_image(self, image: Any, png: bytes) -> None:
        width = str(_png_width(png) // _SCALE)
        if image.width != width:
            image.width = width
        image.value = png

    def _set_stage(self, offsets: Any | None, mesh: Any) -> None:
        """Show the parameter's static pictures on a grid laid out for them (messages only when they change);
        ``offsets`` None (a scalar) shows the mesh alone."""
        from workbench.viz.stage import stage

        pngs = {"mesh": mesh.base[0]}
        if offsets is not None:
            pngs["offsets"] = offsets.base[0]
            if offsets.zoomed:
                pngs["zoom"] = offsets.base[1]
        top = [n for n in ("offsets", "zoom") if n in pngs]
        rows = [("<b>shard offsets</b>", [(n, *_css_size(pngs[n])) for n in top])] if top else []
        rows.append(("<b>mesh</b> (elements of the parameter held)", [("mesh", *_css_size(pngs["mesh"]))]))
        placed = stage(rows)
        images = {"offsets": self.offsets, "zoom": self.zoom_image, "mesh": self.mesh_image}
        for slot in placed.slots:
            image = images[slot.name]
            self._set_image(image, pngs[slot.name])
            image.layout.grid_area = slot.grid_area
            image.layout.display = None
        for name, image in images.items():
            if name not in pngs:
                image.layout.display = "none"
        grid = self.pictures.layout
        grid.grid_template_columns = placed.grid_template_columns
        grid.grid_template_rows = placed.grid_template_rows
        self.rank_view.layout.grid_area = placed.overlay_area
        self._stage = placed

    def _offsets_picture(self, name: str, key: str | None) -> Any:
        return self._kept_picture(("offsets", name, key), lambda: _OffsetsPicture(self.layout.specs[name], key))

    def _mesh_picture(self, name: str) -> Any:
        def draw() -> _MeshPicture:
            from workbench.viz.mesh_figure import plot_mesh

            return _MeshPicture(plot_mesh(self.layout.mesh, self.layout.specs[name], figsize=(5.2, 3.6)))

        return self._kept_picture(("mesh", name), draw)

    def _kept_picture(self, cache: tuple, draw: Callable[[], Any]) -> Any:
        """The picture kept under ``cache``, else the one ``draw()`` makes. The last ``_KEEP_PICTURES`` used are
        kept, whole; the least recently used leave first, so the ones on screen (used by every refresh, and drawn
        on ahead by the background thread) never do."""
        picture = self._pictures.get(cache)
        if picture is None:
            picture = self._pictures[cache] = draw()
        self._pictures.move_to_end(cache)
        while len(self._pictures) > _KEEP_PICTURES:
            self._pictures.popitem(last=False)
        return picture

    def _heat_png(self) -> bytes:
        from workbench.viz.html import _layout_bytes_per_rank
        from workbench.viz.mesh_figure import amount_figure

        values = _layout_bytes_per_rank(self.layout)
        heading = f"bytes per rank: {_style.format_bytes(values.min())} .. {_style.format_bytes(values.max())}"
        fig = amount_figure(self.layout.mesh, values, heading, figsize=(5.2, 3.2))
        return _style.png_bytes(fig, _SCALE)

    # -- schedules ---------------------------------------------------------------------------------------
    def _budget_bytes(self, budget: str | None = None) -> int | None:
        budget = self.budget.value if budget is None else budget
        if budget == "unbounded":
            return None
        fraction = 1 / int(budget.split("/")[1])
        largest = max(math.prod(s.global_shape) * self.layout.dtype(n).itemsize for n, s in self.layout.specs.items())
        return max(1, int(largest * fraction))

    def _policy(self, value: str | None = None) -> Any:
        from workbench.plan.policy import SavePolicy

        value = self.policy.value if value is None else value
        if value.startswith("preserve("):
            return SavePolicy.preserve(value[len("preserve("):-1])
        return SavePolicy.full() if value == "full" else SavePolicy.minimal()

    def _schedule(self, rank: int, policy: str | None = None, budget: str | None = None) -> Any:
        """The rank's schedule under the policy and budget (default: the chosen ones), planned once."""
        policy_value, budget_bytes = self._policy(policy), self._budget_bytes(budget)
        world_key = (str(policy_value), budget_bytes)
        if policy_value.mode in ("full", "gather_only"):
            schedules = self._schedules.get(world_key)
            if schedules is None:  # every rank at once: ranks of one shape class share a schedule
                from workbench.run.simulated import plan_save

                schedules = plan_save(self.layout, policy=policy_value, budget_bytes=budget_bytes).schedules
                self._schedules[world_key] = schedules
            return schedules[rank]
        cache = (*world_key, rank)
        schedule = self._schedules.get(cache)
        if schedule is None:
            from workbench.plan.save_plan import plan_hf_save
            from workbench.plan.schedule import schedule_unshard

            runtime = {n: self.layout.dtype(n) for n in self.layout}
            plans = [plan_hf_save(s, rank, policy_value, runtime_dtype=runtime[n])
                     for n, s in self.layout.specs.items()]
            schedule = schedule_unshard(plans, runtime, budget_bytes)
            self._schedules[cache] = schedule
        return schedule

    def _known_schedule(self, rank: int) -> Any:
        """The rank's schedule if it is planned already, else None."""
        policy_value, budget_bytes = self._policy(), self._budget_bytes()
        world = self._schedules.get((str(policy_value), budget_bytes))
        if world is not None:
            return world[rank]
        return self._schedules.get((str(policy_value), budget_bytes, rank))

    def _show_schedule(self, rank: int) -> None:
        request = (self.policy.value, self.budget.value, rank)
        self._wanted = request
        schedule = self._known_schedule(rank)
        png = self._schedule_png.get(_class_key(schedule)) if schedule is not None else None
        if png is not None:
            self._put_schedule(request, png, schedule)
        elif self._worker is None:
            self._put_planned(request, self._planned(request))
        else:
            self.schedule_note.value = f"<small>planning and drawing rank {rank}'s schedule ...</small>"
            self._worker.submit(("schedule", *request), lambda: self._planned(request),
                                lambda planned: self._put_planned(request, planned))

    def _planned(self, request: tuple) -> tuple[Any, bytes] | str:
        """The schedule of ``request`` (policy, budget, rank) and its picture, or the text of the PlanError
        saying why the layout cannot take that policy (shown in the note: never raised into a change handler
        or the background thread)."""
        failed = self._plan_errors.get(request)
        if failed is not None:
            return failed
        policy, budget, rank = request
        try:
            schedule = self._schedule(rank, policy, budget)
        except PlanError as exc:
            self._plan_errors[request] = str(exc)
            return str(exc)
        return schedule, self._schedule_picture(schedule)

    def _put_planned(self, request: tuple, planned: tuple[Any, bytes] | str) -> None:
        if isinstance(planned, str):
            self._put_plan_error(request, planned)
        else:
            self._put_schedule(request, planned[1], planned[0])

    def _put_plan_error(self, request: tuple, error: str) -> None:
        if request != self._wanted:
            return  # the controls moved on
        # the picture under the note is another policy's (or rank's): cleared and hidden, not passed off as this one's
        self.schedule_image.value = b""
        self.schedule_image.layout.display = "none"
        self.schedule_note.value = _warn(f"no schedule for rank {request[2]} under {request[0]}: {error}")

    def _put_schedule(self, request: tuple, png: bytes, schedule: Any) -> None:
        if request != self._wanted:
            return  # the controls moved on
        self._set_image(self.schedule_image, png)
        self.schedule_image.layout.display = None
        # no rank in the text: while it stays the same (one shape class) a rank change sends nothing
        self.schedule_note.value = (
            f"<small>{schedule.num_calls} call(s), predicted peak {_style.format_bytes(schedule.peak_bytes)} "
            "(every rank of its shape class has this schedule)</small>"
        )

    def _schedule_picture(self, schedule: Any) -> bytes:
        cache = _class_key(schedule)
        png = self._schedule_png.get(cache)
        if png is None:
            from workbench.viz.schedule_figure import plot_schedule

            title = (f"{len(schedule.waves)} wave(s), {len(schedule.rounds)} round(s), {schedule.num_calls} call(s) "
                     f"gathering {_style.format_bytes(sum(c.bytes_out for c in schedule.calls))}")
            png = _style.png_bytes(plot_schedule(schedule, figsize=(9.2, 4.6), title=title), _SCALE)
            if len(self._schedule_png) > 64:
                self._schedule_png.clear()
            self._schedule_png[cache] = png
        return png

    def _classes(self, policy: str, budget: str) -> list[Any]:
        """One schedule per shape class of a policy planned for every rank at once, in rank order."""
        schedules: dict[tuple, Any] = {}
        for rank in self.layout.mesh.all_ranks():
            schedule = self._schedule(rank, policy, budget)
            schedules.setdefault(_class_key(schedule), schedule)
        return list(schedules.values())

    def _drawn_ahead(self, done: int, total: int) -> None:
        if done < total:
            self.progress.value = f"<small>drawing the schedules of {total} shape class(es) ahead: {done} done</small>"
            return
        gc.collect()  # drawing made garbage: collect it now, while nobody moves a control
        self.progress.value = f"<small>schedules of all {total} shape class(es) drawn ahead</small>"

    def _quiet_for(self) -> float:
        """Seconds since the last refresh (the background thread waits for a quiet moment)."""
        return time.perf_counter() - self._last_refresh


# -- pictures -----------------------------------------------------------------------------------------------
class _Dropped(Exception):
    """A drawing ahead stopped because a control moved (the refresh needs the figure)."""


class _Frozen:
    """Figures laid out and drawn once at ``_SCALE`` x their CSS size, without what depends on the rank: their
    PNGs are ``base``, sent once per parameter. What depends on the rank is drawn as marks: an SVG of the
    figure's size shown over the unchanged base image (a few KiB to draw, send and paint). The last ``KEEP``
    are kept; ``lock`` is held while drawing (the background thread draws the ranks next to the chosen one
    ahead)."""

    KEEP = 64

    def __init__(self, *figs: Any) -> None:
        self.figs = figs
        self.base: list[bytes] = []
        for fig in figs:
            fig.set_dpi(_style.DPI * _SCALE)
            fig.canvas.draw()
            fig.set_layout_engine("none")  # laid out for good: what is drawn later lands where the base has room
            self.base.append(_png(fig))
        self.lock = threading.Lock()
        self._kept: OrderedDict[tuple, bytes] = OrderedDict()

    def _kept_or(self, key: tuple, draw: Callable[[], bytes]) -> bytes:
        """The picture kept under ``key`` (without waiting for a drawing in progress), else the one ``draw()``
        makes (then kept)."""
        data = self._kept.get(key)
        if data is not None:
            with contextlib.suppress(KeyError):  # dropped meanwhile by the other thread: still a valid picture
                self._kept.move_to_end(key)
            return data
        with self.lock:
            data = self._kept.get(key)
            if data is None:
                data = self._kept[key] = draw()
                while len(self._kept) > self.KEEP:
                    self._kept.popitem(last=False)
            return data

    def _svg(self, n: int, artists: Sequence[Any]) -> bytes:
        return _style.artists_svg(self.figs[n], artists)


class _OffsetsPicture(_Frozen):
    """The offsets figure of one parameter (or HF key): the overview is static and the rank's outline and zoom
    window are its marks; a zoomed tensor gets a second figure, the zoom panel, whose frame is static and whose
    boxes, outlines and labels around the rank are its marks (``OffsetsFigure.zoom_svg``: written directly, the
    browser draws the text)."""

    def __init__(self, spec: Any, key: str | None) -> None:
        from workbench.viz.offsets_figure import OffsetsFigure, needs_zoom
        from workbench.viz.views import shard_view

        view = shard_view(spec, hf_key=key)
        zoom = needs_zoom(view)
        self.drawing = OffsetsFigure(spec, view, rank=None, zoom_panel="separate" if zoom else False,
                                     figsize=(5.6, 4.6), rank_note=False)
        drawing = self.drawing
        for artist in drawing.dynamic:
            artist.set_visible(False)
        super().__init__(*((drawing.fig, drawing.zoom_fig) if zoom else (drawing.fig,)))
        self._shown: int | None = None

    @property
    def zoomed(self) -> bool:
        """True when the figure has a zoom panel (a second image)."""
        return len(self.figs) > 1

    def marks(self, rank: int, dropped: Callable[[], bool] = bool) -> bytes:
        """SVG of the rank's outline and of the zoom window on the overview (over ``base[0]``)."""
        return self._kept_or(("marks", rank),
                             lambda: self._svg(0, self._show(rank, dropped).dynamic_on(self.drawing.fig)))

    def zoom(self, rank: int, dropped: Callable[[], bool] = bool) -> bytes:
        """SVG of the zoom panel around the rank (over ``base[1]``; only when ``zoomed``)."""
        if not self.zoomed:
            raise ValueError(f"explorer: {self.drawing.view.name} has no zoom panel (every part is readable)")
        if dropped():
            raise _Dropped
        return self._kept_or(("zoom", rank), lambda: self.drawing.zoom_svg(rank))

    def _show(self, rank: int, dropped: Callable[[], bool] = bool) -> Any:
        if self._shown != rank:
            if dropped():
                raise _Dropped
            self.drawing.show_rank(rank, zoom=False)
            self._shown = rank
        return self.drawing


class _MeshPicture(_Frozen):
    """A ``plot_mesh`` figure drawn once; the outline of the chosen ranks is its marks."""

    def __init__(self, fig: Any) -> None:
        self.drawing = fig.drawing
        self.drawing.outline(())
        super().__init__(fig)

    def marks(self, ranks: Sequence[int]) -> bytes:
        """SVG of the outline of ``ranks`` (over ``base[0]``)."""
        ranks = tuple(ranks)
        return self._kept_or(ranks, lambda: self._svg(0, self.drawing.outline(ranks)))


class _Worker:
    """One background thread: the latest request of each kind (older queued ones are dropped; a new one goes
    first, but drawing ``"ahead"`` last), each started only after ``quiet()`` seconds without a refresh
    (drawing while a control moves would slow the refresh: both need the GIL). Stopped at interpreter exit,
    between requests."""

    QUIET = 0.25

    def __init__(self, quiet: Callable[[], float]) -> None:
        self._quiet = quiet
        self._lock = threading.Condition()
        self._queue: list[tuple[tuple, Callable[[], Any], Callable[[Any], None] | None]] = []
        self._running = False
        self._thread: threading.Thread | None = None
        _WORKERS.add(self)

    def submit(self, key: tuple, work: Callable[[], Any], done: Callable[[Any], None] | None) -> None:
        with self._lock:
            if key[0] == "precompute":
                self._queue.append((key, work, done))
            else:  # a newer request replaces a queued one of the same kind and goes first
                self._queue = [q for q in self._queue if q[0][0] != key[0]]
                self._queue.insert(len(self._queue) if key[0] == "ahead" else 0, (key, work, done))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="workbench-explorer", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue or _STOPPING.is_set():
                    self._running = False
                    self._lock.notify_all()
                    return
                self._running = True
            while self._quiet() < self.QUIET and not _STOPPING.is_set():
                time.sleep(self.QUIET / 5)
            with self._lock:
                if not self._queue or _STOPPING.is_set():
                    continue
                _, work, done = self._queue.pop(0)
            try:
                result = work()
                if done is not None:
                    done(result)
            except Exception as exc:  # shown, never raised into a thread nobody joins
                import warnings

                warnings.warn(f"workbench explorer: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)

    def settle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"explorer: background drawing still running after {timeout} s")
                self._lock.wait(min(left, 0.1))

    def stop(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout)


_WORKERS: weakref.WeakSet[_Worker] = weakref.WeakSet()
_STOPPING = threading.Event()


@atexit.register
def _stop_workers() -> None:
    """Let background threads finish their current drawing before the interpreter tears torch and matplotlib
    down under them (a daemon thread inside a C call at exit aborts the process)."""
    _STOPPING.set()
    for worker in list(_WORKERS):
        worker.stop(timeout=10.0)


def _start_rank(mesh: Any, rank: int | None) -> int:
    """``rank``, checked against the mesh's rank array (a sub-mesh's need not be 0..size-1), else its first."""
    every = mesh.all_ranks()
    if rank is None:
        return every[0]
    if rank not in set(every):
        raise LayoutError(f"explore: rank {rank} is not in {mesh!r}; its ranks are {format_ranks(every, limit=8)}")
    return rank


def _rank_slider(w: Any, ranks: Sequence[int], rank: int, layout: Any) -> Any:
    """A slider over ``ranks`` (sorted) whose value is a rank: an IntSlider when they are consecutive (its readout
    takes a typed rank), else a SelectionSlider stopping at each."""
    if ranks[-1] - ranks[0] + 1 == len(ranks):
        return w.IntSlider(value=rank, min=ranks[0], max=ranks[-1], description="rank", continuous_update=False,
                           layout=layout)
    return w.SelectionSlider(options=list(ranks), value=rank, description="rank", continuous_update=False,
                             layout=layout)


def _class_key(schedule: Any) -> tuple:
    return (id(schedule.calls), schedule.peak_bytes)  # ranks of one shape class share their calls


def _png(fig: Any) -> bytes:
    """PNG of what ``fig``'s canvas holds (drawn already), RGBA as drawn."""
    import numpy as np

    from workbench.viz.png import BandEncoder

    return BandEncoder().encode(np.asarray(fig.canvas.buffer_rgba()))


def _png_width(png: bytes) -> int:
    return int.from_bytes(png[16:20], "big")


def _css_size(png: bytes) -> tuple[float, float]:
    """The CSS size a PNG drawn at ``_SCALE`` is shown at."""
    return int.from_bytes(png[16:20], "big") / _SCALE, int.from_bytes(png[20:24], "big") / _SCALE


def _escape(text: str) -> str:
    import html

    return html.escape(text, quote=False)


def _note(text: str) -> str:
    """``text`` (escaped) as a plain note in the message area."""
    return f'<div style="padding: 2px 6px">{_escape(text)}</div>'


def _warn(text: str) -> str:
    return (f'<div style="padding: 2px 6px; border-left: 3px solid {_style.OVER}; font-weight: bold">'
            f"{_escape(text)}</div>")
