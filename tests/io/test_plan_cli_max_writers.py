"""``workbench plan --max-writers`` shows the plan ``save_hf`` runs: only the allowed ranks write (``writer_pool``:
spread over the world, rank 0 first), and a minimal save whose kept keys have no allowed holder gathers as full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main

TOY = Path(__file__).resolve().parents[2] / "sample_meshes" / "toy_expert_tp.toml"  # 8 ranks, 9 HF keys, EP=2


def _plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main(["plan", str(TOY), "--rank", "0", "--write-mode", "gather", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_writer_writes_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan(capsys, "--max-writers", "1")
    # minimal keeps each EP rank's experts on it; rank 0 (the one allowed writer) holds only EP 0's, so the save
    # gathers as full and rank 0 writes all 9 keys (the old plan showed 4 writers, experts on EP 1's ranks)
    assert data["policy"] == "full"
    assert data["writers"]["ranks"] == 1 and data["writers"]["empty"] == [1, 2, 3, 4, 5, 6, 7]
    assert data["ranks"][0]["keys_written"] == 9

