"""Timing an explorer's rank changes in a real page (used by the browser test and ``bench/figures_explorer.py``).

A change is timed from the key press that changes the rank (the ``keydown`` event, seen by a listener on the
page's document before the slider gets it) until the last of the parts it redraws is ready to paint, with
``performance.now()``: the time a person waits, without the test driver's own latency in sending the key. The
parts a rank change redraws are named by their ``workbench-<role>`` class: an image is ready once loaded and
decoded (``img.decode()``), any other element (an HTML widget) at the first animation frame after its content
changed (the frame that paints it).

The floor (``time_floor``): the same key press on a bare ``IntSlider`` whose kernel-side observer writes its
value into an ``HTML`` widget (``FLOOR_CELL``), timed the same way: the cheapest widget update a key can make
in that page, kernel and browser, against which the explorer's times are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CHANGED", "FLOOR_CELL", "JUMPS", "time_floor", "time_rank_changes"]

CHANGED = ("rank",)  # what a rank change redraws: one HTML overlay (the rank's text and every picture's marks)
# a notebook cell of the cheapest update a key press can make: a slider whose value the kernel writes into HTML
FLOOR_CELL = (
    "import ipywidgets as _w\n"
    "floor_slider = _w.IntSlider(value=0, min=0, max=1000, description='floor', continuous_update=False)\n"
    "floor_html = _w.HTML('0')\n"
    "floor_html.add_class('workbench-floor')\n"
    "floor_slider.observe(lambda change: setattr(floor_html, 'value', str(change['new'])), names='value')\n"
    "_w.VBox([floor_slider, floor_html])"
)
# DeepSeek-V3 (16 x 64 mesh) ranks never shown nor next to one shown (neighbours: +-1, +-64) when the
# explorer starts at 512 and steps to 520 and back
JUMPS = (100, 900, 300, 700, 40, 980, 250, 640)

_WATCH = """() => {
    window.__wbReady = [];
    window.__wbArmed = false;
    document.addEventListener('keydown', () => {
        if (window.__wbArmed) { window.__wbStart = performance.now(); window.__wbArmed = false; }
    }, true);
    const roleOf = e => [...e.classList].find(c => c.startsWith('workbench-')).slice('workbench-'.length);
    for (const img of document.querySelectorAll('.workbench-explorer img')) {
        const role = roleOf(img);
        img.addEventListener('load', () => {
            const src = img.src;
            img.decode().then(() => { if (img.src === src) window.__wbReady.push([role, performance.now()]); },
                              () => {});
        });
    }
    const others = [...document.querySelectorAll('.workbench-explorer [class*="workbench-"], .workbench-floor')]
        .filter(e => e.tagName !== 'IMG');
    for (const element of others) {
        const role = roleOf(element);
        new MutationObserver(() => requestAnimationFrame(() => window.__wbReady.push([role, performance.now()])))
            .observe(element, {childList: true, subtree: true, characterData: true});
    }
}"""


def time_rank_changes(page: Any, app: Any, steps: Sequence[tuple[str, int, str]], *,
                      changed: Sequence[str] = CHANGED, pause_ms: int = 400) -> dict[str, dict[str, list[float]]]:
    """Make each ``(kind, rank, how)`` change in turn and time it; ``how`` is ``"right"`` or ``"left"`` (an
    arrow key on the rank slider, which must reach ``rank``) or ``"type"`` (the rank typed into the slider's
    readout). After each change the page waits ``pause_ms`` (a person looks at it).

    Returns:
        per kind, ``{"browser_ms": [...], "kernel_ms": [...]}``; the kernel's time is the explorer's own
        ("updated in"), the Python side of the change.
    """
    page.evaluate(_WATCH)
    slider = app.locator(".widget-slider", has_text="rank").first
    handle = slider.locator(".noUi-handle")
    readout = slider.locator(".widget-readout")
    wanted = json.dumps(list(changed))
    out: dict[str, dict[str, list[float]]] = {}

    def start_and(action: Callable[[], Any]) -> None:
        page.evaluate("window.__wbArmed = true")  # the next keydown starts the clock
        action()

    for kind, rank, how in steps:
        page.evaluate("window.__wbReady = []")
        if how in ("right", "left"):
            handle.focus()
            start_and(lambda how=how: handle.press("ArrowRight" if how == "right" else "ArrowLeft"))
        elif how == "type":
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type(str(rank))
            start_and(lambda: page.keyboard.press("Enter"))
        else:
            raise ValueError(f"time_rank_changes: how must be 'right', 'left' or 'type', got {how!r}")
        elapsed = _wait_ready(page, wanted)
        app.locator(".widget-html-content", has_text=f"rank {rank} (").wait_for(timeout=30_000)
        kernel = app.locator(".widget-html-content", has_text="updated in").last.inner_text()
        got = out.setdefault(kind, {"browser_ms": [], "kernel_ms": []})
        got["browser_ms"].append(round(elapsed, 1))
        got["kernel_ms"].append(float(kernel.split("updated in")[1].split("ms")[0]))
        page.wait_for_timeout(pause_ms)
    return out


def time_floor(page: Any, count: int, *, pause_ms: int = 400) -> list[float]:
    """Time ``count`` steps (right, then left, alternately) of the ``FLOOR_CELL`` slider, each from its key press
    to its HTML's change painted; call after ``time_rank_changes`` or after installing the watch
    (``time_rank_changes(page, app, [])``). Returns the milliseconds of each."""
    slider = page.locator(".widget-slider", has_text="floor").first
    handle = slider.locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    out = []
    for i in range(count):
        page.evaluate("window.__wbReady = []")
        handle.focus()
        page.evaluate("window.__wbArmed = true")
        handle.press("ArrowRight" if i % 2 == 0 else "ArrowLeft")
        out.append(round(_wait_ready(page, '["floor"]'), 1))
        page.wait_for_timeout(pause_ms)
    return out


def _wait_ready(page: Any, wanted: str) -> float:
    """Milliseconds from the armed key press until every role in ``wanted`` (a JSON list) is ready."""
    page.wait_for_function(f"() => {wanted}.every(r => window.__wbReady.some(([role]) => role === r))",
                           timeout=30_000)
    return page.evaluate(
        f"Math.max(...window.__wbReady.filter(([r]) => {wanted}.includes(r)).map(([, t]) => t)) - window.__wbStart")
