"""The explorer in a real JupyterLab and a real Chromium: it renders, and the rank slider changes the picture."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tests.browser.harness import JupyterLab, open_notebook, run_all_cells

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "sample_meshes" / "toy_expert_tp.toml"


def _write_notebook(root: Path) -> str:
    source = (
        "import workbench as wb\n"
        "import workbench.viz\n"
        f"layout = wb.load_layout({str(TOY)!r})\n"
        "app = wb.viz.explore(layout, param='model.layers.0.mlp.experts.fused_w1w3', rank=0)\n"
        "app"
    )
    notebook = new_notebook(cells=[new_code_cell(source)])
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(notebook, root / "explore.ipynb")
    return "explore.ipynb"


def test_explorer_renders_and_follows_the_rank_slider(jupyterlab: JupyterLab, lab_root: Path, lab_page,
                                                      artifacts: Path) -> None:
    page = lab_page
    name = _write_notebook(lab_root)
    try:
        open_notebook(page, jupyterlab, name)
        run_all_cells(page)
        app = page.locator(".workbench-explorer")
        app.wait_for(timeout=60_000)
        images = app.locator("img")
        assert images.count() == 4  # offsets, mesh, bytes-per-rank heat map, schedule
        page.wait_for_function(
            "() => [...document.querySelectorAll('.workbench-explorer img')].every(i => i.naturalWidth > 100)",
            timeout=30_000,
        )
        offsets = images.nth(0)
        offsets.scroll_into_view_if_needed()
        before = offsets.screenshot()
        info = app.locator(".widget-html-content", has_text="rank 0 (fsdp=0, ep=0, tp=0)")
        assert info.count() == 1

        slider = app.locator(".widget-slider", has_text="rank").first
        slider.locator(".noUi-handle").focus()
        page.keyboard.press("ArrowRight")  # rank 0 -> 1
        app.locator(".widget-html-content", has_text="rank 1 (fsdp=0, ep=0, tp=1)").wait_for(timeout=30_000)
        page.wait_for_timeout(300)  # the new PNG is decoded by the time the text updates; let it paint
        after = offsets.screenshot()
        assert after != before, "moving the rank slider did not change the shard-offsets picture"
        assert slider.locator(".widget-readout").inner_text().strip() == "1"
    finally:
        page.screenshot(path=str(artifacts / "explorer_jupyterlab.png"), full_page=True)
