"""``workbench kernel install|list|remove`` through a parser built like the ``workbench`` command's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from workbench.kernel.cli import register


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench")
    register(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def test_install_list_remove_in_a_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["kernel", "install", "--nprocs", "4", "--backend", "gloo", "--name", "wb4", "--prefix",
                 str(tmp_path), "--hang-timeout", "30"]) == 0
    spec_file = tmp_path / "share" / "jupyter" / "kernels" / "wb4" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    assert spec["argv"] == [sys.executable, "-m", "workbench.kernel.app", "-f", "{connection_file}"]
    assert spec["env"]["WORKBENCH_KERNEL_NPROCS"] == "4" and spec["env"]["WORKBENCH_KERNEL_BACKEND"] == "gloo"
    assert spec["env"]["WORKBENCH_KERNEL_HANG_TIMEOUT"] == "30" and spec["language"] == "python"
    assert spec["display_name"] == "workbench SPMD (4 ranks, gloo)"
    assert "WORKBENCH_KERNEL_CLOSE_SOCKETS" not in spec["env"]  # by default stuck ranks are freed by closing
    assert _run(["kernel", "install", "--nprocs", "2", "--name", "keep", "--prefix", str(tmp_path),
                 "--keep-sockets"]) == 0
    kept = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "keep" / "kernel.json").read_text())
    assert kept["env"]["WORKBENCH_KERNEL_CLOSE_SOCKETS"] == "0"
    assert "WORKBENCH_KERNEL_JOIN_TIMEOUT" not in kept["env"] and "WORKBENCH_KERNEL_DEAD_AFTER" not in kept["env"]
    assert _run(["kernel", "install", "--nprocs", "0", "--listen", ":5555", "--name", "cluster", "--prefix",
                 str(tmp_path), "--join-timeout", "600", "--dead-after", "45"]) == 0
    cluster = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "cluster" / "kernel.json").read_text())
    assert cluster["env"]["WORKBENCH_KERNEL_JOIN_TIMEOUT"] == "600"
    assert cluster["env"]["WORKBENCH_KERNEL_DEAD_AFTER"] == "45"
    capsys.readouterr()
    assert _run(["kernel", "list", "--prefix", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert "wb4" in listed and "4 local rank(s), gloo" in listed
    assert _run(["kernel", "remove", "wb4", "--prefix", str(tmp_path)]) == 0
    assert not spec_file.exists()


def test_remove_refuses_kernels_that_are_not_ours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "share" / "jupyter" / "kernels" / "plain"
    other.mkdir(parents=True)
    (other / "kernel.json").write_text(json.dumps({"argv": ["python"], "display_name": "x", "language": "python"}))
    assert _run(["kernel", "remove", "plain", "--prefix", str(tmp_path)]) == 1
    assert "no workbench kernel named 'plain'" in capsys.readouterr().err and other.exists()


def test_install_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["kernel", "install", "--nprocs", "0", "--prefix", str(tmp_path)]) == 2
    assert "nprocs 0: give >= 1 local ranks, or 0 with listen" in capsys.readouterr().err
    assert _run(["kernel", "install", "--nprocs", "0", "--listen", "node0:http", "--prefix", str(tmp_path)]) == 2
    assert "listen 'node0:http': expected HOST:PORT, :PORT or PORT" in capsys.readouterr().err
    assert _run(["kernel", "install", "--nprocs", "2", "--dead-after", "0.5", "--prefix", str(tmp_path)]) == 2
    assert "dead_after 0.5: seconds must be > 1" in capsys.readouterr().err
    for bad in ("0", "-5", "nan"):  # 0 reported every cell; NaN never
        assert _run(["kernel", "install", "--nprocs", "2", "--hang-timeout", bad, "--prefix", str(tmp_path)]) == 2
        assert f"hang_timeout {float(bad)!r}: seconds must be > 0 and finite" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --user and --prefix exclude each other
        _parser().parse_args(["kernel", "install", "--nprocs", "2", "--user", "--prefix", str(tmp_path)])


def test_every_subcommand_description_has_an_example() -> None:
    kernel = _parser()._subparsers._group_actions[0].choices["kernel"]  # type: ignore[union-attr]
    subs = kernel._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(subs) == {"install", "list", "remove"}
    for name, sub in {"kernel": kernel, **subs}.items():
        assert "example" in (sub.description or ""), name
        assert "workbench kernel" in sub.description, name
