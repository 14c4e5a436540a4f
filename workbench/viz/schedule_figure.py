"""The schedule figure: a save's all-gathers on a byte axis, and the memory they need against the budget.

Three peaks can be told apart on it: the gathers' modeled peak (the top of the waterline: send, receive and
merged buffers of a wave; what the budget bounds), the schedule's predicted peak (the gathers plus the outputs
the writer queue may still hold, ``queued_bytes``), and what a real save reported (``SaveResult``'s
``predicted_peak_bytes``, planned with that save's writer queue, and a measured device peak on CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from workbench.viz import _style
from workbench.viz.offsets_figure import _axes_size_pt, _laid_out
from workbench.viz.ticks import use_byte_ticks
from workbench.viz.views import schedule_view

__all__ = ["measured_of", "plot_schedule"]

_WAVE_LINES = 48  # wave separators drawn up to this many waves (more would grey the whole plot)


def measured_of(measured: Any) -> dict[str, Any]:
    """Normalize what ``plot_schedule`` overlays: a SaveResult, a mapping, or None.

    Understood fields: ``call_seconds`` (one per call), ``peak_bytes`` (measured peak), ``seconds`` (total),
    ``predicted_peak_bytes`` (the real save's own prediction, writer queue included). A SaveResult carries
    ``seconds`` and ``predicted_peak_bytes``; per-call times come from ``workbench.viz.measure.TimedCommunicator``.
    """
    if measured is None:
        return {}
    fields = ("call_seconds", "peak_bytes", "seconds", "predicted_peak_bytes")
    if isinstance(measured, Mapping):
        data = dict(measured)
    else:
        data = {k: getattr(measured, k) for k in fields if hasattr(measured, k)}
    return {k: v for k, v in data.items() if v is not None and not (isinstance(v, (tuple, list)) and not v)}


def plot_schedule(schedule: Any, measured: Any = None, *, figsize: tuple[float, float] = (10.0, 6.2),
                  title: str | None = None) -> Any:
    """Draw an UnshardSchedule as a timeline and its modeled memory waterline against the budget.

    Top: one bar per all-gather call, in execution order along a byte axis (width = the bytes the call gathers,
    ``GatherCall.bytes_out``), one lane per (mesh dim, dtype), waves separated by dotted lines, bars labelled
    ``wNrM`` (wave N, round M) where the label fits, oversized tensors hatched red. Bottom: the gathers' modeled
    live memory through the save (red where it is above the budget), the budget, the gathers' peak and, when
    the save keeps a writer queue, the predicted peak with it. The title says when the peak is over budget.
    ``measured`` (a SaveResult, ``TimedCommunicator.measured(result)`` or a mapping with ``call_seconds``,
    ``peak_bytes``, ``seconds``, ``predicted_peak_bytes``) adds per-call times and the real save's peaks.

    Args:
        title: replaces the first line of the title (the rank and counts).

    Returns:
        The Figure; each call's bar is a Rectangle with gid ``call-<index>``; ``fig.view`` is the
        ``ScheduleView``.
    """
    from matplotlib.patches import Patch, Rectangle

    view = schedule_view(schedule)
    meas = measured_of(measured)
    times = meas.get("call_seconds")
    fig = _style.new_figure(figsize)
    heights = [max(1.2, 0.45 * len(view.lanes) + 0.6), 2.0] + ([1.1] if times is not None else [])
    axes = list(fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights}))
    ax, mem = axes[0], axes[1]
    palette = _style.lane_colours(len(view.lanes))
    total = max(view.total_bytes, 1)
    for bar in view.bars:
        ax.add_patch(Rectangle(
            (bar.x, bar.lane + 0.1), bar.width, 0.8, facecolor=_style.OVER if bar.oversized else palette[bar.lane],
            edgecolor="white", linewidth=0.4, hatch="xx" if bar.oversized else None, gid=f"call-{bar.call}",
        ))
    separators = len(view.wave_starts) <= _WAVE_LINES
    if separators:
        for start in view.wave_starts[1:]:
            for a in axes:
                a.axvline(start, color="0.55", lw=0.6, ls=":")
    ax.set_ylim(max(len(view.lanes), 1), 0)  # nothing to gather: an empty lane, not singular limits
    ax.set_yticks(np.arange(len(view.lanes)) + 0.5, view.lanes, fontsize=_style.MIN_PT)
    ax.set_xlim(0, total)
    handles = [Patch(facecolor="white", edgecolor="none", label="bar: one all-gather call,\nwidth = bytes it gathers"),
               Patch(facecolor="white", edgecolor="none", label="wNrM: wave N, round M"),
               Patch(facecolor="white", edgecolor="0.55", linestyle=":",
                     label="dotted: a new wave" if separators else f"{len(view.wave_starts)} waves (lines\nleft out)")]
    if any(b.oversized for b in view.bars):
        handles.append(Patch(facecolor=_style.OVER, hatch="xx", edgecolor="white",
                             label="oversized: larger than the\nbudget, gathered alone"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=_style.MIN_PT,
              frameon=False, handlelength=1.0, borderaxespad=0)
    _title(fig, ax, schedule, view, title)
    _memory(mem, view, meas)
    if times is not None:
        _times(axes[2], view, palette, list(times), meas)
    elif meas.get("seconds") is not None:
        mem.set_title(f"measured save: {meas['seconds']:.3f} s", fontsize=_style.LABEL_PT)
    last = axes[-1]
    last.set_xlabel("bytes gathered, in call order", fontsize=_style.LABEL_PT)
    use_byte_ticks(last.xaxis)
    for a in axes:
        a.tick_params(labelsize=_style.MIN_PT)
    if len(view.bars) <= 400:
        _laid_out(fig)
        width_pt = _axes_size_pt(ax)[0]
        for bar in view.bars:
            label = f"w{bar.wave}r{bar.round}"
            if bar.width / total * width_pt >= _style.text_width_pt(label) + 4:
                fill = _style.OVER if bar.oversized else palette[bar.lane]
                ax.text(bar.x + bar.width / 2, bar.lane + 0.5, label, ha="center", va="center",
                        fontsize=_style.MIN_PT, color=_style.text_on(fill),
                        bbox={"facecolor": fill, "edgecolor": "none", "pad": 0.5} if bar.oversized else None)
    fig.view = view
    return fig


def _title(fig: Any, ax: Any, schedule: Any, view: Any, title: str | None) -> None:
    fmt = _style.format_bytes
    budget = "unbounded" if view.budget_bytes is None else fmt(view.budget_bytes)
    head = title or (f"rank {schedule.rank}: {len(schedule.waves)} wave(s), {len(schedule.rounds)} round(s), "
                     f"{schedule.num_calls} call(s) gathering {fmt(view.total_bytes)}")
    fig.suptitle(f"{head}; budget {budget}", fontsize=_style.TITLE_PT)
    if view.over_budget:
        oversized = len({i.name for c in schedule.calls if c.oversized for i in c.items})
        why = f"{oversized} tensor(s) larger than the budget, each gathered alone" if oversized else ""
        warning = f"OVER BUDGET: predicted peak {fmt(view.peak_bytes)} > budget {budget}" + (f"\n{why}" if why else "")
        ax.set_title(warning, fontsize=_style.LABEL_PT, color=_style.OVER, fontweight="bold")


def _memory(mem: Any, view: Any, meas: dict[str, Any]) -> None:
    from matplotlib.patches import Rectangle

    fmt = _style.format_bytes
    line = mem.step(view.water_x, view.water_y, where="post", color="#1f77b4", lw=1.3,
                    label="gathers' live memory (modeled)", gid="waterline")[0]
    tops = [max(view.water_y, default=0), view.gather_peak_bytes, view.peak_bytes]
    mem.axhline(view.gather_peak_bytes, color="#1f77b4", ls="--", lw=0.9, gid="gather-peak",
                label=f"gathers' peak {fmt(view.gather_peak_bytes)}\n(send + receive + merged; what the budget "
                      "bounds)")
    if view.peak_bytes > view.gather_peak_bytes:
        mem.axhline(view.peak_bytes, color="#9467bd", ls="--", lw=0.9, gid="predicted-peak",
                    label=f"predicted peak {fmt(view.peak_bytes)}\n(+ writer queue <= {fmt(view.queued_bytes)})")
    if view.budget_bytes is not None:
        # a budget far above every peak stays off the scale (the waterline would be a flat line at zero)
        far = view.budget_bytes > 4 * max(tops)
        mem.axhline(view.budget_bytes, color=_style.OVER, lw=1.2, gid="budget",
                    label=f"budget {fmt(view.budget_bytes)}" + (" (above the scale)" if far else ""))
        if not far:
            tops.append(view.budget_bytes)
        over = mem.step(view.water_x, view.water_y, where="post", color=_style.OVER, lw=1.6, gid="waterline-over",
                        label="above the budget")[0]
        clip = Rectangle((0, view.budget_bytes), max(view.total_bytes, 1), max(tops) * 10, transform=mem.transData)
        over.set_clip_path(clip)
        if max(view.water_y, default=0) <= view.budget_bytes:
            over.set_label("_nolegend_")
        del line
    save_peak = meas.get("predicted_peak_bytes")
    if save_peak is not None and int(save_peak) != view.peak_bytes:
        mem.axhline(int(save_peak), color="#8c564b", ls=(0, (1, 1)), lw=1.2, gid="save-predicted-peak",
                    label=f"the save's predicted peak {fmt(int(save_peak))}\n(gathers + its writer queue, "
                          "host_buffer_bytes)")
        tops.append(int(save_peak))
    if meas.get("peak_bytes") is not None:
        mem.axhline(meas["peak_bytes"], color="black", ls="-.", lw=1.0, gid="measured-peak",
                    label=f"measured peak {fmt(int(meas['peak_bytes']))}\n(device allocations of the whole save)")
        tops.append(int(meas["peak_bytes"]))
    mem.set_ylim(0, max(max(tops) * 1.12, 1))
    mem.set_ylabel("bytes", fontsize=_style.LABEL_PT)
    use_byte_ticks(mem.yaxis)
    mem.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=_style.MIN_PT, frameon=False,
               borderaxespad=0)


def _times(tax: Any, view: Any, palette: list[Any], times: list[float], meas: dict[str, Any]) -> None:
    from matplotlib.patches import Rectangle

    for bar, sec in zip(view.bars, times):
        tax.add_patch(Rectangle((bar.x, 0), bar.width, sec, facecolor=palette[bar.lane], gid=f"time-{bar.call}"))
    tax.set_ylim(0, max(times, default=0) * 1.15 or 1)
    tax.set_ylabel("s / call", fontsize=_style.LABEL_PT)
    note = f"measured: {len(times)} call(s), {sum(times):.3f} s in gathers"
    if meas.get("seconds") is not None:
        note += f", {meas['seconds']:.3f} s save"
    tax.set_title(note, fontsize=_style.LABEL_PT)
    if len(times) != len(view.bars):
        tax.text(0.5, 0.5, f"{len(times)} measured calls vs {len(view.bars)} planned", transform=tax.transAxes,
                 ha="center", color=_style.OVER, fontsize=_style.LABEL_PT)
