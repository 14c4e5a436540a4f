"""Timing an explorer's rank changes in a real page (used by the browser test and ``bench/figures_explorer.py``).

A change is timed from the key press that changes the rank (the ``keydown`` event, seen by a listener on the
page's document before the slider gets it) until the last of the images it redraws is loaded and decoded
(``img.decode()``: ready to paint), with ``performance.now()``: the time a person waits, without the test
driver's own latency in sending the key. The images a rank change redraws are named by their
``workbench-<role>`` class.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CHANGED", "JUMPS", "time_rank_changes"]

CHANGED = ("offsets-marks", "zoom-marks", "mesh-marks")  # what a rank change on a zoomed tensor redraws
# DeepSeek-V3 (16 x 64 mesh) ranks never shown nor next to one shown (neighbours: +-1, +-64) when the
# explorer starts at 512 and steps to 520 and back
JUMPS = (100, 900, 300, 700, 40, 980, 250, 640)

_WATCH = """() => {
    window.__wbReady = [];
    window.__wbArmed = false;
    document.addEventListener('keydown', () => {
        if (window.__wbArmed) { window.__wbStart = performance.now(); window.__wbArmed = false; }
    }, true);
    for (const img of document.querySelectorAll('.workbench-explorer img')) {
        const role = [...img.classList].find(c => c.startsWith('workbench-')).slice('workbench-'.length);
        img.addEventListener('load', () => {
            const src = img.src;
            img.decode().then(() => { if (img.src === src) window.__wbReady.push([role, performance.now()]); },
                              () => {});
        });
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
        page.wait_for_function(f"() => {wanted}.every(r => window.__wbReady.some(([role]) => role === r))",
                               timeout=30_000)
        elapsed = page.evaluate(
            f"Math.max(...window.__wbReady.filter(([r]) => {wanted}.includes(r)).map(([, t]) => t)) - window.__wbStart")
        app.locator(".widget-html-content", has_text=f"rank {rank} (").wait_for(timeout=30_000)
        kernel = app.locator(".widget-html-content", has_text="updated in").last.inner_text()
        got = out.setdefault(kind, {"browser_ms": [], "kernel_ms": []})
        got["browser_ms"].append(round(elapsed, 1))
        got["kernel_ms"].append(float(kernel.split("updated in")[1].split("ms")[0]))
        page.wait_for_timeout(pause_ms)
    return out
