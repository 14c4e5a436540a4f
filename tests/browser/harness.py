"""A reusable real-browser harness: JupyterLab on loopback and headless Chromium driven by Playwright.

Other tests import it (``from tests.browser.harness import ...``) or use the ``jupyterlab`` and ``lab_page``
fixtures of ``tests/browser/conftest.py``:

    with JupyterLab(root) as lab, chromium_page() as page:
        page.goto(lab.url("lab/tree/my.ipynb"))
        run_all_cells(page)

JupyterLab listens on 127.0.0.1 only, on a free port, behind a random token, with its config, data and runtime
directories private to the run (the kernels and lab extensions of this Python stay visible). Chromium is
Debian's ``/usr/bin/chromium`` (or ``$WORKBENCH_CHROMIUM``), launched by Playwright through
``executable_path`` with a fresh profile; Playwright never downloads a browser here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "CHROMIUM_FLAGS",
    "JupyterLab",
    "chromium_page",
    "find_chromium",
    "missing_reason",
    "open_notebook",
    "run_all_cells",
]

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def find_chromium() -> str | None:
    """Path of the Chromium to drive: ``$WORKBENCH_CHROMIUM``, else ``chromium`` on PATH, else None."""
    explicit = os.environ.get("WORKBENCH_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_reason() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    if find_chromium() is None:
        return ("no Chromium on this machine (looked for $WORKBENCH_CHROMIUM, chromium, chromium-browser); "
                "install Debian's: apt-get install -y chromium")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install playwright; no browser download needed)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """A JupyterLab server on 127.0.0.1 serving ``root``; a context manager that stops it (and its kernels).

    Attributes:
        port, token: where it listens and the token every request needs.
        log: the server's combined stdout/stderr file (read it when a test fails).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        startup_timeout: float = 90.0,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """``env`` adds to the server's environment: pass ``JUPYTER_DATA_DIR`` (or ``JUPYTER_PATH``) to show
        kernels installed there; by default the data dir is private to the run (this Python's kernels and lab
        extensions, under ``sys.prefix``, are always found). ``extra_args`` go to ``jupyter lab``."""
        self.root = Path(root)
        self.env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        self._home = Path(tempfile.mkdtemp(prefix="workbench-lab-"))
        self.log = self._home / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def url(self, path: str = "lab") -> str:
        """Full URL of ``path`` on the server, token included."""
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}{sep}token={self.token}"

    def __enter__(self) -> JupyterLab:
        env = dict(os.environ)
        env.update({
            "JUPYTER_CONFIG_DIR": str(self._home / "config"),
            "JUPYTER_RUNTIME_DIR": str(self._home / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(self._home / "lab-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(self._home / "lab-workspaces"),
            "JUPYTER_DATA_DIR": str(self._home / "data"),
            "JUPYTER_PLATFORM_DIRS": "1",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]),
        })
        env.update(self.env)
        news = self._home / "lab-settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        news.parent.mkdir(parents=True, exist_ok=True)
        news.write_text('{"fetchNews": "false", "checkForUpdates": false}')  # no pop-up over the page, no network
        command = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
            "--ServerApp.open_browser=False", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
            command.append("--allow-root")
        command += self.extra_args
        with open(self.log, "wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             cwd=self.root, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"JupyterLab exited with {self._process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        tail = self.log.read_text()[-3000:]
        self.__exit__(None, None, None)
        raise RuntimeError(f"JupyterLab did not answer within {self.startup_timeout} s:\n{tail}")

    def __exit__(self, *exc: Any) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()  # the server shuts its kernels down on SIGTERM
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(self._home, ignore_errors=True)


@contextlib.contextmanager
def chromium_page(*, viewport: tuple[int, int] = (1400, 1000)) -> Iterator[Any]:
    """A Playwright page in headless Debian Chromium with a fresh profile; closed on exit."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    if executable is None:
        raise RuntimeError(missing_reason() or "no chromium")
    profile = tempfile.mkdtemp(prefix="workbench-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=executable, headless=True, args=list(CHROMIUM_FLAGS),
                viewport={"width": viewport[0], "height": viewport[1]},
            )
            try:
                page = context.pages[0] if context.pages else context.new_page()
                yield page
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def open_notebook(page: Any, lab: JupyterLab, name: str, *, timeout: float = 60.0) -> None:
    """Open ``name`` (relative to the server root) in JupyterLab and wait until its kernel is idle."""
    page.goto(lab.url(f"lab/tree/{name}"), timeout=timeout * 1000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout * 1000)
    _wait_idle(page, timeout)


def run_all_cells(page: Any, *, timeout: float = 120.0) -> None:
    """Run every cell of the open notebook (Run menu > Run All Cells); wait until each code cell has run."""
    _wait_idle(page, timeout)
    page.locator(".jp-Notebook").first.click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function(
        """() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                   .every(p => /\\[\\d+\\]/.test(p.textContent))""",
        timeout=timeout * 1000,
    )
    _wait_idle(page, timeout)


def _wait_idle(page: Any, timeout: float) -> None:
    """Wait until a kernel is connected and idle (status bar ``<kernel> | Idle``) and no cell shows ``[*]``."""
    page.wait_for_function(
        """() => {
            const items = [...document.querySelectorAll('.jp-StatusBar-TextItem')].map(e => e.textContent.trim());
            const idle = items.some(t => / \\| Idle$/.test(t) && !t.startsWith('No Kernel'));
            const busy = [...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'));
            return idle && !busy;
        }""",
        timeout=timeout * 1000,
    )
