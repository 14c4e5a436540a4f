"""The explorer in a real JupyterLab and a real Chromium: it renders sharp images, follows the rank slider, and on
DeepSeek-V3 (1,024 ranks) a rank change reaches the screen quickly, first visits included.

Timing: from the key press that changes the rank (its ``keydown`` in the page) until what a rank change
redraws (one HTML overlay: the rank's text and the inline SVG marks over the offsets overview, the zoom panel and
the mesh) is painted (the first animation frame after it changed), measured in the page with
``performance.now()``; and the floor, the same key press on a bare slider whose value the kernel writes into an
HTML widget, timed the same way in the same page. Three kinds of change: a step right on the slider to a rank
never shown (drawn ahead in the background while the page waits, as a person looks at the last one), a step back
to a rank shown before, and a jump typed into the slider's readout to a rank far from any shown (drawn on the
change). The numbers, with the kernel's own time and the machine's load, go to ``tests/artifacts/explorer_timing.json``.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tests.browser.explorer_timing import FLOOR_CELL, JUMPS, time_floor, time_rank_changes
from tests.browser.harness import JupyterLab, run_all_cells

pytestmark = pytest.mark.slow
PlaywrightTimeout = pytest.importorskip("playwright.sync_api").TimeoutError

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "sample_meshes" / "toy_expert_tp.toml"
DEEPSEEK = ROOT / "sample_meshes" / "deepseek_v3_671b.toml"
# the browser's budget for a rank change, median per kind. Issue 23 asks <= 100 ms. A rank change is one widget
# message (one HTML value: the rank's text and every picture's inline SVG marks over the static PNGs): the kernel
# spends 1-4 ms on a step (drawn ahead), 13-41 ms on a typed jump (drawn on the change). Measured on this 2-core
# machine shared with other jobs, 8 runs at load 0.8-4.4: medians 30-46 ms for steps to new ranks, 27-47 ms for
# steps back, 39-68 ms for typed jumps, against a floor (a bare slider writing an HTML widget, same page) of 25-42 ms.
# Bounds: the worst median seen + ~50-70% (the load here often climbs to 8-11)
UPDATE_LIMIT_MS = {"first visit": 80, "repeat visit": 80, "jump": 100}


def _write_notebook(root: Path, name: str, layout: Path, param: str, rank: int) -> str:
    source = (
        "import workbench as wb\n"
        "import workbench.viz\n"
        f"layout = wb.load_layout({str(layout)!r})\n"
        f"app = wb.viz.explore(layout, param={param!r}, rank={rank})\n"
        "app"
    )
    notebook = new_notebook(cells=[new_code_cell(source), new_code_cell(FLOOR_CELL)])
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(notebook, root / name)
    return name


def _open_explorer(page, jupyterlab: JupyterLab, name: str):
    # ?reset: this notebook alone, not the tabs an earlier test of the same server left open
    page.goto(jupyterlab.url(f"lab/tree/{name}?reset"), timeout=60_000)
    select = page.get_by_role("button", name="Select", exact=True)
    try:  # a later notebook of the same server may ask which kernel to start
        select.wait_for(timeout=5_000)
        select.click()
    except PlaywrightTimeout:  # no dialog: the notebook's kernel started by itself
        pass
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    run_all_cells(page, timeout=240)
    app = page.locator(".workbench-explorer")
    app.wait_for(timeout=120_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.workbench-explorer img')].filter(i => i.offsetParent)"
        ".every(i => i.naturalWidth > 100)",
        timeout=60_000,
    )
    return app


def _slider_handle(app):
    slider = app.locator(".widget-slider", has_text="rank").first
    handle = slider.locator(".noUi-handle")
    handle.focus()
    return slider, handle


def _role(image) -> str:
    return image.evaluate("i => [...i.classList].find(c => c.startsWith('workbench-')).slice('workbench-'.length)")


def test_explorer_renders_and_follows_the_rank_slider(jupyterlab: JupyterLab, lab_root: Path, lab_page,
                                                      artifacts: Path) -> None:
    page = lab_page
    name = _write_notebook(lab_root, "explore.ipynb", TOY, "model.layers.0.mlp.experts.fused_w1w3", 0)
    try:
        app = _open_explorer(page, jupyterlab, name)
        images = app.locator("img")
        # offsets overview, zoom (hidden: the toy needs none), mesh, heat, schedule
        assert images.count() == 5
        shown = {_role(images.nth(i)): images.nth(i) for i in range(images.count()) if images.nth(i).is_visible()}
        assert sorted(shown) == ["heat", "mesh", "offsets", "schedule"]
        for image in shown.values():
            natural, css = image.evaluate("i => [i.naturalWidth, i.getBoundingClientRect().width]")
            assert natural == pytest.approx(2 * css, abs=2)  # hi-dpi: two image pixels per CSS pixel
        marks = app.locator(".workbench-rank svg")
        assert marks.count() == 2
        for i in range(marks.count()):  # each picture's inline SVG marks lie exactly over it
            svg = marks.nth(i)
            box, under = svg.bounding_box(), shown[svg.get_attribute("data-picture")].bounding_box()
            assert box == pytest.approx(under, abs=0.01), svg.get_attribute("data-picture")
        offsets = shown["offsets"]
        offsets.scroll_into_view_if_needed()
        before = offsets.screenshot()  # the page where the overview is: its marks included
        assert app.locator(".widget-html-content", has_text="rank 0 (fsdp=0, ep=0, tp=0)").count() == 1
        slider, _ = _slider_handle(app)
        page.keyboard.press("ArrowRight")  # rank 0 -> 1
        app.locator(".widget-html-content", has_text="rank 1 (fsdp=0, ep=0, tp=1)").wait_for(timeout=30_000)
        page.wait_for_timeout(300)  # let the new marks paint
        after = offsets.screenshot()
        assert after != before, "moving the rank slider did not change the shard-offsets picture"
        assert slider.locator(".widget-readout").inner_text().strip() == "1"
        # the HF key picker filters as one types (a datalist of the keys)
        key_box = app.locator("input[list]").nth(1)
        assert key_box.evaluate("i => i.list.options.length") == 5  # (whole tensor) + 4 keys
    finally:
        page.screenshot(path=str(artifacts / "explorer_jupyterlab.png"), full_page=True)


def test_deepseek_rank_change_reaches_the_screen_quickly(jupyterlab: JupyterLab, lab_root: Path, lab_page,
                                                         artifacts: Path) -> None:
    page = lab_page
    name = _write_notebook(lab_root, "explore_deepseek.ipynb", DEEPSEEK, "model.layers.3.mlp.experts.fused_w1w3", 512)
    load_before = os.getloadavg()
    try:
        app = _open_explorer(page, jupyterlab, name)
        assert app.locator("img.workbench-zoom").is_visible(), "a 1,024-row part of 1,048,576 rows gets the zoom"
        # the kernel draws the schedules of every shape class in the background after the explorer shows
        app.locator(".widget-html-content", has_text="drawn ahead").filter(has_text="all").wait_for(timeout=120_000)
        steps = [("first visit", rank, "right") for rank in range(513, 521)]  # new ranks, a step right each
        steps += [("repeat visit", rank, "left") for rank in range(519, 511, -1)]  # back over ranks shown
        steps += [("jump", rank, "type") for rank in JUMPS]  # far from any rank shown: drawn on the change
        timed = time_rank_changes(page, app, steps)
        floor = time_floor(page, 9)
        timings = {kind: got["browser_ms"] for kind, got in timed.items()}
        kernel_ms = {kind: got["kernel_ms"] for kind, got in timed.items()}
        summary = {k: {"median_ms": statistics.median(v), "max_ms": max(v), "n": len(v), "all_ms": v,
                       "kernel_median_ms": statistics.median(kernel_ms[k]), "kernel_all_ms": kernel_ms[k]}
                   for k, v in timings.items()}
        # the cheapest widget update a key press makes in this page: the explorer's times read against it
        summary["floor"] = {"median_ms": statistics.median(floor), "max_ms": max(floor), "n": len(floor),
                            "all_ms": floor}
        summary["machine"] = {"cpus": os.cpu_count(), "load_average_before": load_before,
                              "load_average_after": os.getloadavg()}
        (artifacts / "explorer_timing.json").write_text(json.dumps(summary, indent=1))
        for kind in timings:
            assert summary[kind]["median_ms"] <= UPDATE_LIMIT_MS[kind], f"{kind}: {summary[kind]}"
    finally:
        page.screenshot(path=str(artifacts / "explorer_deepseek_jupyterlab.png"), full_page=True)
