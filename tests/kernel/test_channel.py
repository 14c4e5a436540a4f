"""The rank channel's guards, against a listening ``RankSet`` driven by raw ZMQ peers (no torch ranks, fast).

A peer without the token, one that takes an admitted rank's ZMQ identity, and forged or replayed messages get
nothing from the kernel and nothing they send is returned to it; ``--listen`` binds loopback unless a host is
given, and warns when it binds every interface. Honest peers sign with ``protocol.Link`` (the rank side's code);
the signature's bytes are checked against an HMAC computed here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from workbench.kernel import ranks as ranks_module
from workbench.kernel.protocol import Link, Rejected, encode, new_identity, parse_listen, read_token
from workbench.kernel.ranks import RankSet

LOGGER = "test.kernel.channel"
MARK = "INJECTED-BY-AN-INTRUDER"


def hello(rank: int, world_size: int = 2) -> dict[str, Any]:
    return {"op": "hello", "rank": rank, "world_size": world_size, "local_rank": rank, "host": "node", "pid": 1,
            "backend": "gloo"}


def display(text: str = MARK) -> dict[str, Any]:
    return {"op": "display", "id": "cell", "rank": 0, "data": {"text/plain": text}, "metadata": {}}


class Peer:
    """A DEALER that talks to the kernel as a rank would (signing with ``key``), or forges whatever it is told."""

    def __init__(self, context: zmq.Context, address: str, key: bytes, rank: int, identity: str | None = None):
        self.identity = identity or new_identity(rank)
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.link = Link(key, me="rank", rank=rank, identity=self.identity)

    def send(self, message: dict[str, Any]) -> list[bytes]:
        frames = self.link.seal(encode(message))
        self.socket.send_multipart(frames)
        return frames

    def received(self, wait: float = 0.3) -> list[list[bytes]]:
        got = []
        while self.socket.poll(int(wait * 1000)):
            got.append(self.socket.recv_multipart())
        return got


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[tuple[RankSet, bytes]]:
    """A kernel's rank set that listens on loopback, and the token it wrote (read back from its file)."""
    rankset = RankSet(nprocs=0, backend="gloo", listen="127.0.0.1:0", token_file=str(tmp_path / "token"),
                      log=logging.getLogger(LOGGER))
    try:
        yield rankset, (tmp_path / "token").read_text().strip().encode()
    finally:
        rankset.close()


def pump(rankset: RankSet, seconds: float = 0.5) -> list[tuple[int, dict[str, Any]]]:
    """Everything the kernel accepts within ``seconds``."""
    got = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        message = rankset.recv(left)
        if message is not None:
            got.append(message)
    return got


def join(rankset: RankSet, peer: Peer, rank: int) -> None:
    peer.send(hello(rank))
    assert [(r, m["op"]) for r, m in pump(rankset)] == [(rank, "hello")]
    assert rank in rankset.ranks


def test_the_wire_is_signed_with_hmac_sha256_of_the_token(kernel: tuple[RankSet, bytes],
                                                          context: zmq.Context) -> None:
    rankset, key = kernel
    assert Path(rankset.token_file).stat().st_mode & 0o777 == 0o600
    peer = Peer(context, rankset.address, key, 0)
    join(rankset, peer, 0)
    rankset.send(0, {"op": "execute", "code": "x = 1"})
    [(signature, header, body)] = peer.received()
    length = len(header).to_bytes(4, "big")
    assert signature == hmac.new(key, length + header + body, hashlib.sha256).digest()
    assert json.loads(header) == {"from": "kernel", "rank": 0, "id": peer.identity, "seq": 1}
    assert json.loads(body) == {"op": "execute", "code": "x = 1"}


def test_a_peer_with_a_wrong_token_is_not_admitted_and_gets_nothing(kernel: tuple[RankSet, bytes],
                                                                     context: zmq.Context,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    rankset, key = kernel
    intruder = Peer(context, rankset.address, b"0" * 64, 1)
    with caplog.at_level(logging.WARNING, LOGGER):
        intruder.send(hello(1))
        intruder.socket.send(encode({**hello(1), "token": "0" * 64}))  # the old, unsigned hello
        intruder.send(display())
        assert pump(rankset) == [] and rankset.ranks == {}
    assert "bad signature" in caplog.text and "unsigned or malformed" in caplog.text and rankset.dropped == 3
    honest = Peer(context, rankset.address, key, 0)
    join(rankset, honest, 0)
    rankset.broadcast({"op": "execute", "code": "secret()"})
    assert intruder.received() == []
    assert [json.loads(f[2])["code"] for f in honest.received()] == ["secret()"]


def test_a_second_connection_with_an_admitted_identity_gets_nothing_and_injects_nothing(
        kernel: tuple[RankSet, bytes], context: zmq.Context) -> None:
    rankset, key = kernel
    honest = Peer(context, rankset.address, key, 0)
    join(rankset, honest, 0)
    thief = Peer(context, rankset.address, b"0" * 64, 0, identity=honest.identity)  # ZMQ handover attempt
    time.sleep(0.2)
    thief.socket.send(encode(display()))
    thief.send(display())
    thief.send({"op": "comm", "msg_type": "comm_msg", "content": {"comm_id": MARK, "data": {}}})
    assert pump(rankset) == []
    rankset.send(0, {"op": "execute", "code": "secret()"})
    assert thief.received() == []
    assert len(honest.received()) == 1  # the rank keeps its connection
    honest.send(display("real"))
    assert [m["data"] for _, m in pump(rankset)] == [{"text/plain": "real"}]


def test_forged_messages_on_an_admitted_connection_are_dropped_and_logged(kernel: tuple[RankSet, bytes],
                                                                          context: zmq.Context,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    rankset, key = kernel
    peer = Peer(context, rankset.address, key, 0)
    join(rankset, peer, 0)
    body = encode(display())
    header = json.dumps({"from": "rank", "rank": 0, "id": peer.identity, "seq": 99}).encode()
    other = json.dumps({"from": "rank", "rank": 1, "id": peer.identity, "seq": 99}).encode()
    elsewhere = json.dumps({"from": "rank", "rank": 0, "id": new_identity(0), "seq": 99}).encode()
    as_kernel = json.dumps({"from": "kernel", "rank": 0, "id": peer.identity, "seq": 99}).encode()

    def sign(h: bytes) -> bytes:
        return hmac.new(key, len(h).to_bytes(4, "big") + h + body, hashlib.sha256).digest()

    forgeries = [
        [body],  # unsigned (today's format)
        [b"", header, body],  # missing signature
        [bytes(32), header, body],  # wrong signature
        [sign(header), header, encode(display("changed"))],  # signed body swapped
        [sign(other), other, body],  # signed for another rank
        [sign(elsewhere), elsewhere, body],  # signed for another connection
        [sign(as_kernel), as_kernel, body],  # the kernel's direction reflected back
    ]
    with caplog.at_level(logging.WARNING, LOGGER):
        for frames in forgeries:
            peer.socket.send_multipart(frames)
        assert pump(rankset) == []
    assert rankset.dropped == len(forgeries)
    for reason in ("unsigned or malformed", "bad signature", "signed for rank 1", "signed for connection",
                   "comes from 'kernel'"):
        assert reason in caplog.text
    peer.send(display("real"))  # the connection is not poisoned
    assert [m["data"] for _, m in pump(rankset)] == [{"text/plain": "real"}]


def test_a_replayed_message_is_dropped(kernel: tuple[RankSet, bytes], context: zmq.Context,
                                       caplog: pytest.LogCaptureFixture) -> None:
    rankset, key = kernel
    peer = Peer(context, rankset.address, key, 0)
    hello_frames = peer.send(hello(0))
    shown = peer.send(display("once"))
    assert [m["op"] for _, m in pump(rankset)] == ["hello", "display"]
    with caplog.at_level(logging.WARNING, LOGGER):
        peer.socket.send_multipart(shown)  # same connection, same frames
        peer.socket.send_multipart(hello_frames)
        replayer = Peer(context, rankset.address, b"", 0)  # a new connection replays the captured hello
        replayer.socket.send_multipart(hello_frames)
        replayer.socket.send_multipart(shown)
        assert pump(rankset) == []
    assert "replayed" in caplog.text and "signed for connection" in caplog.text
    rankset.send(0, {"op": "execute", "code": "secret()"})
    assert replayer.received() == []


def test_the_kernel_side_drops_replays_and_forgeries_too() -> None:
    key = b"k" * 64
    identity = new_identity(3)
    kernel = Link(key, me="kernel", rank=3, identity=identity)
    rank = Link(key, me="rank", rank=3, identity=identity)
    first = kernel.seal(encode({"op": "execute", "code": "a"}))
    assert rank.open(first)["code"] == "a"
    with pytest.raises(Rejected, match="replayed"):
        rank.open(first)
    with pytest.raises(Rejected, match="bad signature"):
        rank.open(Link(b"other", me="kernel", rank=3, identity=identity).seal(encode({"op": "exit"})))
    with pytest.raises(Rejected, match="signed for connection"):
        rank.open(Link(key, me="kernel", rank=3, identity=new_identity(3)).seal(encode({"op": "exit"})))
    assert rank.open(kernel.seal(encode({"op": "exit"}))) == {"op": "exit"}


def test_a_signed_message_from_a_connection_that_never_said_hello_is_dropped(
        kernel: tuple[RankSet, bytes], context: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    rankset, key = kernel
    with caplog.at_level(logging.WARNING, LOGGER):
        stranger = Peer(context, rankset.address, key, 0)
        stranger.send(display())
        assert pump(rankset) == []
    assert "never passed hello" in caplog.text


def test_a_second_hello_for_an_admitted_rank_is_refused_while_the_first_is_alive(
        kernel: tuple[RankSet, bytes], context: zmq.Context, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rankset, key = kernel
    monkeypatch.setattr(ranks_module, "_ALIVE", 2.0)
    first = Peer(context, rankset.address, key, 0)
    join(rankset, first, 0)
    second = Peer(context, rankset.address, key, 0)
    with caplog.at_level(logging.WARNING, LOGGER):
        second.send(hello(0))
        assert pump(rankset, 0.3) == []
    assert "rank 0 is already admitted on another connection" in caplog.text
    [refused] = [second.link.open(frames) for frames in second.received()]  # told, so it does not wait forever
    assert refused["op"] == "refused" and "already admitted on another connection" in refused["reason"]
    assert refused["retry_after"] == 1.0  # half the time a silent rank keeps its place: say hello again then
    rankset.send(0, {"op": "execute", "code": "a"})
    assert second.received() == [] and len(first.received()) == 1
    time.sleep(2.2)  # the first one fell silent: a new hello may take its place
    second.send(hello(0))
    assert [m["op"] for _, m in pump(rankset)] == ["hello"]
    rankset.send(0, {"op": "execute", "code": "b"})
    assert first.received() == []
    [execute] = second.received()  # numbered above the refusal it had: the rank's link accepts it
    assert second.link.open(execute) == {"op": "execute", "code": "b"}


def test_a_hello_refused_for_good_is_told_why_and_not_asked_again(kernel: tuple[RankSet, bytes],
                                                                  context: zmq.Context) -> None:
    rankset, key = kernel
    join(rankset, Peer(context, rankset.address, key, 0), 0)  # the kernel's world is now 2 ranks
    for bad, why in ((hello(1, world_size=4), "says world size 4, this kernel's world size is 2"),
                     ({**hello(1), "pid": "none"}, "lacks invalid literal")):
        late = Peer(context, rankset.address, key, 1)
        late.send(bad)
        assert pump(rankset, 0.3) == []
        [refused] = [late.link.open(frames) for frames in late.received()]
        assert refused["op"] == "refused" and why in refused["reason"] and "retry_after" not in refused
    admitted = Peer(context, rankset.address, key, 1)
    join(rankset, admitted, 1)
    admitted.send(hello(1))  # a second hello on its own connection: dropped, and the admitted rank is not told to go
    assert pump(rankset, 0.3) == [] and admitted.received() == []
    stranger = Peer(context, rankset.address, b"0" * 64, 1)  # no token: told nothing at all
    stranger.send(hello(1))
    assert pump(rankset, 0.3) == [] and stranger.received() == []


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) where this process listens on ``port``."""
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            address, _, hex_port = cols[1].rpartition(":")
            if cols[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.mark.parametrize("listen", [":0", "0"])
def test_listen_without_a_host_binds_loopback(listen: str, tmp_path: Path) -> None:
    rankset = RankSet(nprocs=0, backend="gloo", listen=listen, token_file=str(tmp_path / "t"))
    try:
        port = int(rankset.address.rsplit(":", 1)[1])
        assert rankset.address == f"tcp://127.0.0.1:{port}"
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, little-endian hex
        assert rankset.warnings == []
    finally:
        rankset.close()


def test_listening_on_every_interface_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, LOGGER):
        rankset = RankSet(nprocs=0, backend="gloo", listen="0.0.0.0:0", token_file=str(tmp_path / "t"),
                          log=logging.getLogger(LOGGER))
    try:
        port = int(rankset.address.rsplit(":", 1)[1])
        assert _listening(port) == {"00000000"}
        [warning] = rankset.warnings
        assert "listening for ranks on every interface (0.0.0.0:0" in warning and warning in caplog.text
        assert rankset.token_file is not None and rankset.token_file.read_text().strip() not in warning
    finally:
        rankset.close()
    assert not (tmp_path / "t").exists()  # a stopped kernel leaves no token behind


@pytest.mark.parametrize(("text", "expected"), [("5555", ("127.0.0.1", 5555)), (":0", ("127.0.0.1", 0)),
                                                ("node0:29500", ("node0", 29500)), ("[::]:7", ("::", 7)),
                                                ("0.0.0.0", ("0.0.0.0", 0))])
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


def test_read_token_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("abc\n")
    path.chmod(0o600)
    assert read_token(str(path), {}) == "abc"
    assert read_token(None, {"WORKBENCH_KERNEL_TOKEN_FILE": str(path)}) == "abc"
    assert read_token(None, {"WORKBENCH_KERNEL_TOKEN": "xyz", "WORKBENCH_KERNEL_TOKEN_FILE": str(path)}) == "xyz"
    path.chmod(0o644)
    with pytest.raises(ValueError, match="has mode 644: others may read it; chmod 600"):
        read_token(str(path), {})
    with pytest.raises(ValueError, match="no kernel token: pass --token-file PATH"):
        read_token(None, {})


@pytest.mark.parametrize("ended_before", [True, False], ids=["agent-ended-before-stop", "agent-ended-when-told"])
def test_stop_keeps_the_ranks_log_of_an_agent_that_ended_on_its_own(tmp_path: Path, ended_before: bool) -> None:
    # an agent whose ranks all exited with code 0 mid-cell ends with code 0 too; the kernel's RanksStopped error names
    # its log, so the restart the error asks for must not delete it. An agent that ends when stop() tells it goes.
    import subprocess
    import sys

    rankset = RankSet(nprocs=0, backend="gloo", listen="127.0.0.1:0", token_file=str(tmp_path / "token"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ranks.log").write_text("rank 0 leaving\n")
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
    if ended_before:
        agent.wait(10)
    rankset._agent, rankset._run_dir = agent, run_dir
    try:
        rankset.stop()
    finally:
        rankset.close()
    assert agent.returncode == 0
    assert run_dir.exists() == ended_before


_SIGNALLED = "W1129 07:00:00 api.py:1029] Sending process 4242 closing signal SIGTERM\n"
_FAILED = "E1129 07:00:00 api.py:1002] failed (exitcode: 3) local_rank: 1 (pid: 4243) of binary: python\n"


@pytest.mark.parametrize("log", [_SIGNALLED, _FAILED, "rank 1 says goodbye\n"],
                         ids=["agent-signalled-the-others", "agent-named-the-failure", "agent-carries-on"])
def test_a_rank_that_ended_is_gone_at_once_only_while_its_agent_carries_on(tmp_path: Path, log: str) -> None:
    # a rank that exited with code 0 leaves torch's agent running: the kernel names it after a few seconds. One that
    # failed makes the agent signal the others and exit, which on a busy host takes longer than that: the agent's exit
    # (RanksStopped, with the root cause) is awaited instead of calling the rank lost
    import subprocess
    import sys

    from workbench.kernel.ranks import RankInfo
    from workbench.pid_space import this_pid_space

    rankset = RankSet(nprocs=0, backend="gloo", listen="127.0.0.1:0", token_file=str(tmp_path / "token"))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(30)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    rankset.log_path = tmp_path / "ranks.log"
    rankset.log_path.write_text("x" * 100_000 + "\n" + log)  # only the log's end is read
    stopping = log != "rank 1 says goodbye\n"
    rankset._agent = agent
    rankset.ranks[1] = RankInfo(rank=1, world_size=2, local_rank=1, host=socket.gethostname(), pid=ended.pid,
                                backend="gloo", pid_space=this_pid_space())
    try:
        assert rankset.exited([1], after=0.0) == ([] if stopping else [1])
        assert rankset.agent_is_stopping() == stopping
        agent.kill()
        agent.wait(30)
        assert not rankset.agent_is_stopping()  # an agent that exited says it all itself
    finally:
        rankset._agent = None
        rankset.close()
