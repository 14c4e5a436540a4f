"""A block size below 1 byte is an error, never a verdict: it once made the hash loops read nothing, so differing
checkpoints were judged healthy (exit 0), and 0 was reported as an unreadable checkpoint (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.debug.corpus import broken, model, write
from workbench.debug import diagnose, diff_checkpoints
from workbench.debug.diff import compare_sources, open_checkpoint
from workbench.debug.source import MemorySource

KEY = "model.norm.weight"


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A reference and a checkpoint that differs from it in one element of one key."""
    return write(tmp_path / "a", model()), broken(tmp_path, "b", lambda t: t[KEY].add_(1.0))


@pytest.mark.parametrize("block", [0, -1, -5, -(1 << 20)])
def test_the_api_rejects_a_block_size_below_1_naming_it(pair: tuple[Path, Path], block: int) -> None:
    a, b = pair
    calls = [lambda: diff_checkpoints(a, b, block_bytes=block),
             lambda: diagnose(b, str(a), block_bytes=block),
             lambda: diagnose(b, model(), block_bytes=block),
             lambda: open_checkpoint(a, block),
             lambda: compare_sources(MemorySource(model()), MemorySource(model()), block_bytes=block)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"block_bytes.*{block}"):
            call()


def test_the_smallest_block_still_finds_the_difference(pair: tuple[Path, Path]) -> None:
    a, b = pair
    report = diff_checkpoints(a, b, block_bytes=1)
    assert [f.key for f in report.findings] == [KEY] and report.exit_status == 1, report.to_text()


def test_digest_refuses_a_block_that_would_hash_nothing() -> None:
    from workbench.debug.diff import _digest

    source = MemorySource({KEY: torch.ones(4)})
    for block in (0, -3):
        with pytest.raises(ValueError, match=f"block {block}"):
            _digest(source, KEY, 0, 16, block)


@pytest.mark.parametrize("command", ["diff", "diagnose"])
@pytest.mark.parametrize("size", ["-5", "0", "0.1", "-0.5KiB", "0B", "nan", "infMiB", "lots"])
def test_the_cli_rejects_a_bad_block_size_as_a_usage_error(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
                                                           command: str, size: str) -> None:
    from workbench.cli import main

    a, b = (str(p) for p in pair)
    argv = [command, a, b] if command == "diff" else [command, b, "--expected", a]
    with pytest.raises(SystemExit) as done:
        main([*argv, f"--block-size={size}"])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage:" in err and "--block-size" in err and repr(size) in err, err


@pytest.mark.parametrize(("size", "expected"), [("1", 1), ("64B", 64), ("2KiB", 2048), ("0.5MiB", 1 << 19)])
def test_the_cli_reads_sizes_with_units(size: str, expected: int) -> None:
    from workbench.debug.cli import _block

    assert _block(size) == expected


def test_the_cli_still_finds_the_difference_with_a_small_block(pair: tuple[Path, Path]) -> None:
    from workbench.cli import main

    a, b = (str(p) for p in pair)
    assert main(["diff", a, b, "--block-size", "1"]) == 1
    assert main(["diagnose", b, "--expected", a, "--block-size", "3B"]) == 1


@pytest.mark.parametrize("block", [1.5e6, "32MiB", True])
def test_the_api_rejects_a_block_size_that_is_not_an_int(pair: tuple[Path, Path], block: object) -> None:
    a, b = pair
    with pytest.raises(TypeError, match="block_bytes must be an int"):
        diff_checkpoints(a, b, block_bytes=block)
