"""A rank's sys.stdout / sys.stderr (``worker._RankStream``) against a stand-in worker: where each line goes."""

from __future__ import annotations

import io
from typing import Any

from workbench.kernel.worker import _RankStream


class _Worker:
    """What ``_RankStream`` reads of a rank: its cells (as ``_Worker._execute`` keeps them) and its outbox."""

    rank = 1

    def __init__(self) -> None:
        self.cell: str | None = None
        self.last_cell: str | None = None
        self.send_streams = True
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def _stream() -> tuple[_Worker, _RankStream, io.StringIO]:
    worker, log = _Worker(), io.StringIO()
    return worker, _RankStream(worker, "stdout", log, 1), log  # type: ignore[arg-type]


def test_before_the_first_cell_text_goes_to_the_log() -> None:
    worker, stream, log = _stream()
    stream.write("starting up\n")
    stream.flush()
    assert log.getvalue() == "starting up\n" and worker.sent == []


def test_between_cells_whole_lines_go_under_the_last_cell() -> None:
    # a thread the cell started, or native output read from descriptor 1, after the cell ended (ipykernel shows
    # such output under the last cell)
    worker, stream, log = _stream()
    worker.cell = "cell-1"
    stream.write("in the cell\n")
    worker.last_cell, worker.cell = "cell-1", None
    stream.write("tick 1\ntick")
    assert [(m["id"], m["text"]) for m in worker.sent] == [("cell-1", "in the cell\n"), ("cell-1", "tick 1\n")]
    stream.flush()  # an unterminated line goes when flushed, as in a cell
    assert worker.sent[-1] == {"op": "stream", "id": "cell-1", "rank": 1, "name": "stdout", "text": "tick"}
    assert log.getvalue() == ""


def test_between_cells_a_rank_whose_output_is_not_shown_keeps_it_in_the_log() -> None:
    # %rank_output 0: the other ranks' output after the last cell is not shown, and kept in the log (a watchdog's
    # report between cells must not vanish)
    worker, stream, log = _stream()
    worker.last_cell, worker.send_streams = "cell-1", False
    stream.write("hidden\n")
    assert worker.sent == [] and log.getvalue() == "hidden\n"
