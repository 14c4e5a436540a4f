"""The launcher kernel in a real JupyterLab and a real Chromium: its card is in the launcher, and a notebook
opened from that card runs a cell on both ranks and shows the folded output.

The kernel (2 gloo ranks) is installed into a temp prefix that the server finds through ``JUPYTER_PATH``, as a
user's ``workbench kernel install --prefix DIR`` would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import JupyterLab, missing_reason
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow

NAME = "wb-browser-gloo-2"
DISPLAY = "workbench SPMD browser check (2 ranks, gloo)"
CELL = "print('same on every rank')\nprint(f'rank {rank} of {world_size}')"
# what folding must show (the kernel's contract in the issue: one line for text every rank printed, the other
# lines prefixed with the ranks that printed them)
EXPECTED = ["same on every rank", "[0] rank 0 of 2", "[1] rank 1 of 2"]


@pytest.fixture(scope="module")
def jupyterlab(lab_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    """Overrides the conftest fixture: a JupyterLab that also sees a 2-rank workbench kernel in a temp prefix."""
    reason = missing_reason()
    if reason:
        pytest.skip(f"real-browser test skipped: {reason}")
    prefix = tmp_path_factory.mktemp("kernel-prefix")
    install_kernel(nprocs=2, backend="gloo", name=NAME, prefix=str(prefix), display_name=DISPLAY)
    with JupyterLab(lab_root, env={"JUPYTER_PATH": str(prefix / "share" / "jupyter")}) as lab:
        yield lab


def test_kernel_card_in_launcher_and_a_cell_runs_on_both_ranks(jupyterlab: JupyterLab, lab_page,
                                                                artifacts: Path) -> None:
    page = lab_page
    try:
        page.goto(jupyterlab.url("lab"), timeout=60_000)
        card = page.locator(f".jp-Launcher-section:has-text('Notebook') .jp-LauncherCard[title='{DISPLAY}']")
        card.wait_for(timeout=60_000)
        assert card.count() == 1
        page.screenshot(path=str(artifacts / "kernel_jupyterlab_launcher.png"))
        card.click()  # a new notebook on our kernel
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        page.wait_for_function(  # the status bar names our kernel, idle: both ranks joined
            f"""() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
                   .some(e => e.textContent.trim() === {DISPLAY + ' | Idle'!r})""",
            timeout=90_000,
        )
        page.locator(".jp-Notebook .jp-Cell .cm-content").first.click()
        page.keyboard.insert_text(CELL)  # no key events: no bracket auto-closing or auto-indent
        page.keyboard.press("Shift+Enter")
        output = page.locator(".jp-Notebook .jp-CodeCell").first.locator(".jp-OutputArea-output")
        output.first.wait_for(timeout=60_000)
        page.wait_for_function(
            """() => { const o = document.querySelector('.jp-CodeCell .jp-OutputArea-output');
                       return o && o.textContent.includes('[1] rank 1 of 2'); }""",
            timeout=60_000,
        )
        lines = [line for line in output.first.inner_text().splitlines() if line.strip()]
        assert lines == EXPECTED
        prompt = page.locator(".jp-Notebook .jp-CodeCell").first.locator(".jp-InputPrompt").inner_text()
        assert prompt.strip() == "[1]:"
    finally:
        page.screenshot(path=str(artifacts / "kernel_jupyterlab.png"))
