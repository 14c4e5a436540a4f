"""wb.launch's reports and clean-up, mostly without starting ranks: which rank a LaunchError names first, a result
that cannot travel back, and the log folder of a launch that ends with something other than a LaunchError.

wb.launch's multi-rank tests live in tests/dist/test_launch.py; the one here that starts ranks uses 2."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, make_dataclass
from pathlib import Path

import pytest

from workbench import LaunchError, launch
from workbench.run.launcher import _failures


@dataclass
class _TorchFailure:
    """What torch's agent knows of a failed rank (its ``ProcessFailure``)."""

    local_rank: int
    pid: int
    exitcode: int
    timestamp: float


def _record(log_dir: Path, rank: int, when: float, message: str) -> None:
    (log_dir / f"failure-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": 100 + rank, "time": when, "kind": "error", "message": message,
         "traceback": f"Traceback (most recent call last):\n{message}\n"}))


def test_a_rank_killed_by_a_signal_is_named_before_the_peer_that_lost_its_connection(tmp_path: Path) -> None:
    # rank 0 was SIGKILLed and left no record; rank 1, waiting for it, raised "Connection closed by peer" first
    # (torch's agent counts the crash in whole seconds, after it noticed)
    _record(tmp_path, 1, 1000.2, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:41135")
    crash = _TorchFailure(local_rank=0, pid=100, exitcode=-signal.SIGKILL, timestamp=1001)
    failures = _failures({0: crash}, str(tmp_path))
    assert [f.rank for f in failures] == [0, 1]
    assert failures[0].message.startswith("killed by signal SIGKILL") and failures[0].exitcode == -9


def test_a_crash_without_a_record_comes_after_a_rank_that_raised(tmp_path: Path) -> None:
    # an error a rank recorded is the cause; a peer that then died natively (an abort, no record) is not
    _record(tmp_path, 1, 1000.9, "ValueError: a bad batch")
    crash = _TorchFailure(local_rank=0, pid=100, exitcode=-signal.SIGABRT, timestamp=1000)
    assert [f.rank for f in _failures({0: crash}, str(tmp_path))] == [1, 0]


# a class as a notebook cell defines it: in its __main__, which in a rank is not the notebook's
_Point = make_dataclass("Point", [("x", int)], namespace={"__module__": "__main__"})


def _a_point() -> object:
    import torch.distributed as dist

    return _Point(dist.get_rank())


@pytest.mark.slow
def test_a_result_that_does_not_pickle_is_named_with_its_type_and_the_pickling_error() -> None:
    # the rank pickled its result after its log was closed: "exit code 1, no error recorded; its stderr log is empty"
    with pytest.raises(LaunchError) as info:
        launch(_a_point, nprocs=2, timeout=60)
    first = info.value.failures[0]  # the other rank may have been stopped before it recorded its own
    assert not first.timed_out and first.exitcode == 1
    assert first.message.startswith(f"rank {first.rank} returned a __main__.Point from "
                                    f"tests.run.test_launcher._a_point, which cannot be sent back to the launching "
                                    f"process (results travel by pickle): PicklingError: "), first.message
    assert "a class defined in a notebook" in first.message and "importable module" in first.message
    assert "no error recorded" not in str(info.value)


def test_the_pickling_probe_leaves_tensors_unshared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pickling a tensor for another process moves it to shared memory (a CUDA one: an IPC reference the receiver
    # must release); the probe must leave that to torch's one real pickling
    import torch

    from workbench.run.launcher import _RECORDS_ENV, _refuse_a_result_that_does_not_pickle

    monkeypatch.setenv(_RECORDS_ENV, str(tmp_path))
    tensor = torch.ones(4)
    _refuse_a_result_that_does_not_pickle(0, "f", {"t": tensor, "p": torch.nn.Parameter(torch.ones(2)), "n": [1, "a"]})
    assert not tensor.is_shared() and list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match=r"rank 0 returned a list from f, which cannot be sent back.*_thread\.lock"):
        _refuse_a_result_that_does_not_pickle(0, "f", [tensor, __import__("threading").Lock()])
    assert [p.name for p in tmp_path.iterdir()] == ["failure-rank0.json"] and not tensor.is_shared()
    loss = torch.ones(2, requires_grad=True) * 2  # torch's own reducer refuses it: the probe must too
    with pytest.raises(TypeError, match=r"rank 1 returned a dict .*requires grad and is not a leaf.*detach"):
        _refuse_a_result_that_does_not_pickle(1, "f", {"loss": loss})
    _refuse_a_result_that_does_not_pickle(1, "f", {"loss": loss.detach(), "w": torch.ones(2, requires_grad=True)})


def _one() -> int:
    return 1


@pytest.mark.parametrize("nprocs", [2.0, True])
def test_an_nprocs_that_is_no_int_is_refused_naming_it(
        nprocs: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2.0 failed deep in torch's agent ("'float' object cannot be interpreted as an integer"), its log folder left
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TypeError, match=rf"launch: nprocs must be an int .*, got {nprocs!r} \({type(nprocs).__name__}"):
        launch(_one, nprocs=nprocs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"nnodes": 2.0}, TypeError, r"launch: nnodes must be an int \(the number of hosts\), got 2\.0 \(float\)"),
    ({"node_rank": True}, TypeError, r"launch: node_rank must be an int .*, got True \(bool\)"),
    ({"nnodes": 0}, ValueError, r"launch: nnodes must be >= 1, got 0"),
    ({"nnodes": 2, "node_rank": 2}, ValueError, r"launch: node_rank must be below nnodes \(2\), got 2"),
])
def test_nnodes_and_node_rank_are_checked_before_anything_starts(
        kwargs: dict, error: type, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(error, match=message):
        launch(_one, nprocs=1, **kwargs)
    assert list(tmp_path.iterdir()) == []


def _agent_that_raises(error: BaseException) -> object:
    def elastic_launch(config: object, entrypoint: object) -> object:
        def run(*args: object) -> None:
            raise error

        return run

    return elastic_launch


def test_a_launch_interrupted_by_sigint_raises_keyboardinterrupt_and_leaves_no_log_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's agent turns a SIGINT into its own SignalException (after it stopped the ranks); the launch's log folder
    # was kept, as for a LaunchError, but no error pointed at it
    import tempfile

    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(api, "elastic_launch", _agent_that_raises(SignalException("got SIGINT", signal.SIGINT)))
    with pytest.raises(KeyboardInterrupt):
        launch(_one, nprocs=2)
    assert list(tmp_path.iterdir()) == []
    sigterm = SignalException("got SIGTERM", signal.SIGTERM)
    monkeypatch.setattr(api, "elastic_launch", _agent_that_raises(sigterm))
    with pytest.raises(SignalException) as info:
        launch(_one, nprocs=2)
    assert info.value is sigterm and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(api, "elastic_launch", _agent_that_raises(RuntimeError("the agent broke")))
    with pytest.raises(RuntimeError, match="the agent broke"):
        launch(_one, nprocs=2)
    assert list(tmp_path.iterdir()) == []
