"""The launcher kernel against ``jupyter_kernel_test``, the suite other Jupyter kernels test with, using the very
samples that suite gives for IPython's own kernel (its ``test_ipykernel.py``): completion, inspect, is_complete,
history, the pager payload of ``zip?``, rich output, errors. Plus what JupyterLab needs beyond that suite:
``comm_info`` lists rank 0's comms (widgets are restored after a page reload), completion of the kernel's own
names, and a full ``kernel_info``. One kernel of 2 gloo ranks serves the module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

jkt = pytest.importorskip("jupyter_kernel_test")

from tests.kernel.support import execute, jupyter_path  # noqa: E402
from workbench.kernel.spec import install_kernel  # noqa: E402

pytestmark = pytest.mark.slow

NAME = "wb-conformance-2"


class TestIPythonSamples(jkt.KernelTests):
    """jupyter_kernel_test's IPython samples, unchanged, run against a workbench kernel of 2 gloo ranks."""

    kernel_name = NAME
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]  # noqa: RUF012 (the suite reads class attributes)
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]  # noqa: RUF012
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]  # noqa: RUF012
    invalid_code_samples = ["import = 7q"]  # noqa: RUF012
    code_page_something = "zip?"
    code_generate_error = "raise"
    code_execute_result = [{"code": "1+2+3", "result": "6"},  # noqa: RUF012
                           {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"}]
    code_display_data = [  # noqa: RUF012
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))", "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))", "mime": "text/latex"},
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls) -> None:
        from jupyter_client.manager import start_new_kernel

        cls._prefix = Path(tempfile.mkdtemp(prefix="wb-conformance-"))
        install_kernel(nprocs=2, backend="gloo", name=NAME, prefix=str(cls._prefix))
        # rank 0's history goes to a database of this test's own (never the user's ~/.ipython)
        with jupyter_path(cls._prefix):
            cls.km, cls.kc = start_new_kernel(kernel_name=NAME, startup_timeout=120,
                                              env={**os.environ, "IPYTHONDIR": str(cls._prefix / "ipython")})
        first = execute(cls.kc, "pass", timeout=180)  # the suite's 15 s per reply does not cover starting ranks
        assert first.reply["status"] == "ok", first.reply

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        shutil.rmtree(cls._prefix, ignore_errors=True)

    # -- beyond the suite: what JupyterLab relies on ------------------------------------------------------------
    def test_completion_sees_the_kernels_own_names_on_rank_0(self) -> None:
        execute(self.kc, "workbench_value_on_rank = 10 + rank")
        for text, expected in (("world_si", "world_size"), ("workbench_value_on", "workbench_value_on_rank"),
                               ("import colle", "collections")):
            msg_id = self.kc.complete(text)
            reply = self.get_non_kernel_info_reply(timeout=30)
            assert reply["parent_header"]["msg_id"] == msg_id
            content = reply["content"]
            assert expected in content["matches"], (text, content)
            assert content["cursor_end"] == len(text)
            assert text[content["cursor_start"]:] == text.rsplit(" ", 1)[-1]  # the word being completed

    def test_inspect_shows_rank_0s_object(self) -> None:
        execute(self.kc, "inspected = {'rank': rank}")
        self.kc.inspect("inspected", 3)
        content = self.get_non_kernel_info_reply(timeout=30)["content"]
        assert content["found"] and "{'rank': 0}" in content["data"]["text/plain"], content
        self.kc.inspect("no_such_name_anywhere", 5)
        assert self.get_non_kernel_info_reply(timeout=30)["content"]["found"] is False

    def test_comm_info_lists_rank_0s_comms(self) -> None:
        out = execute(self.kc, "import ipywidgets\nslider = ipywidgets.IntSlider()\nslider.comm.comm_id")
        comm_id = out.result.strip("'")
        self.kc.comm_info()
        comms = self.get_non_kernel_info_reply(timeout=30)["content"]["comms"]
        assert comms.get(comm_id) == {"target_name": "jupyter.widget"}, comms
        self.kc.comm_info(target_name="no.such.target")
        assert self.get_non_kernel_info_reply(timeout=30)["content"]["comms"] == {}

    def test_kernel_info_is_complete(self) -> None:
        self.kc.kernel_info()
        content = self.kc.get_shell_msg(timeout=30)["content"]
        assert content["status"] == "ok" and content["implementation"] == "workbench-spmd"
        assert content["language_info"]["name"] == "python" and content["language_info"]["file_extension"] == ".py"
        assert content["language_info"]["pygments_lexer"] == "ipython3"
        links = {link["text"] for link in content["help_links"]}
        assert {"Python Reference", "IPython Reference", "PyTorch Distributed"} <= links, links
        assert content["debugger"] is False
        assert content["banner"].startswith("workbench SPMD kernel")
