"""Fixtures of the real-browser tests: a JupyterLab server per module and a fresh Chromium page per test.

Both skip, saying why, when this machine has no Chromium or no playwright package.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import JupyterLab, chromium_page, missing_reason

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory JupyterLab serves (tests write their notebooks here)."""
    return tmp_path_factory.mktemp("lab-root")


@pytest.fixture(scope="module")
def jupyterlab(lab_root: Path) -> Iterator[JupyterLab]:
    """A JupyterLab on 127.0.0.1 serving ``lab_root``, stopped after the module."""
    reason = missing_reason()
    if reason:
        pytest.skip(f"real-browser test skipped: {reason}")
    with JupyterLab(lab_root) as lab:
        yield lab


@pytest.fixture
def lab_page(jupyterlab: JupyterLab) -> Iterator[object]:
    """A headless Chromium page (fresh profile); the server log is attached to failures."""
    with chromium_page() as page:
        yield page


@pytest.fixture
def artifacts() -> Path:
    """``tests/artifacts/``: screenshots a person can look at after the run."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
