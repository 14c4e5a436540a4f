"""What the kernel and its ranks say to each other over ZMQ: signed JSON messages on one bound connection per rank.

The kernel binds a ROUTER socket (never handing an identity over to a second connection); every rank connects one
DEALER whose ZMQ identity it draws at random (``rank3-<32 hex>``), so no other peer can guess it. Every message,
both ways, is three frames, as in Jupyter's own wire protocol: an HMAC-SHA256 signature keyed with the kernel's
token, a header and a JSON body (never a pickle: a rank's port may face a cluster network). The signature covers the
header and the body; the header names the sender (``kernel`` or ``rank``), the rank, the rank's identity and a
sequence number that grows with every message in each direction. So a message proves its sender holds the token, is
bound to the one connection it names, and is refused when captured and sent again (``Link.open``). The token itself
never travels: ranks a scheduler starts read it from a file of mode 0600 or an environment variable
(``read_token``), never from their command line.

kernel -> rank: ``execute`` (code, ranks shown), ``stacks``, ``interrupt``, ``release`` (close the process groups'
connections and destroy the groups, so peers stuck in a collective get an error), ``reinit`` (new process
groups), ``query`` (completion, inspection, history or comms of the rank's shell), ``comm``, ``ping``, ``exit``
(with an exit code: nonzero when the kernel ended a job that lost ranks), ``dump_peer`` (read the stack of a rank of
the same host that cannot answer), ``refused`` (a signed hello not admitted: the reason, and ``retry_after`` seconds
when the same hello may pass later).
rank -> kernel: ``hello``, ``stream``, ``display``, ``clear_output``, ``comm``, ``done`` (with the shell's payloads:
the pager's text), ``stacks``, ``answer``, ``peer_dump``, ``released``, ``reinit_done``, ``pong``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_CONNECT", "ENV_HOST", "ENV_KERNEL_PID", "ENV_RUN_DIR", "ENV_SILENCE", "ENV_TOKEN", "ENV_TOKEN_FILE",
    "WILDCARD_HOSTS",
    "Link", "Rejected",
    "check_address", "decode", "encode", "new_identity", "new_token", "parse_listen", "read_token", "write_token_file",
]

ENV_CONNECT = "WORKBENCH_KERNEL_CONNECT"  # the kernel's address, set by the kernel for the ranks it starts itself
ENV_KERNEL_PID = "WORKBENCH_KERNEL_PID"  # local ranks exit when this process is gone
ENV_RUN_DIR = "WORKBENCH_KERNEL_RUN_DIR"  # where local ranks keep their stack dump and ledger files
ENV_HOST = "WORKBENCH_KERNEL_HOST"  # the host name a rank reports (default: its hostname), e.g. a node's name
ENV_SILENCE = "WORKBENCH_KERNEL_SILENCE_S"  # a rank exits after this many seconds without a word from a gone kernel
ENV_TOKEN = "WORKBENCH_KERNEL_TOKEN"  # the token itself (what a scheduler may set in a job's environment)
ENV_TOKEN_FILE = "WORKBENCH_KERNEL_TOKEN_FILE"  # a file holding the token: the kernel writes it, ranks read it
WILDCARD_HOSTS = ("0.0.0.0", "*", "::")  # hosts that bind every interface
_SENDERS = ("kernel", "rank")


class Rejected(ValueError):
    """A message that must not be acted on: unsigned, badly signed, replayed, or not from the connection it names."""


def new_token() -> str:
    """A fresh kernel token: 32 random bytes as hex (the HMAC key of the rank channel)."""
    return secrets.token_hex(32)


def new_identity(rank: int) -> str:
    """A rank's ZMQ identity for one process: its rank plus 128 random bits, so nobody else can claim it."""
    return f"rank{rank}-{secrets.token_hex(16)}"


def encode(message: Mapping[str, Any]) -> bytes:
    """A message body as bytes on the wire."""
    return json.dumps(message, separators=(",", ":"), default=str).encode()


def decode(frame: bytes) -> dict[str, Any]:
    """Bytes from the wire -> message; raises ValueError on anything that is not a JSON object with an op."""
    message = json.loads(frame)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError("not a workbench kernel message")
    return message


def _mac(key: bytes, header: bytes, body: bytes) -> bytes:
    mac = hmac.new(key, len(header).to_bytes(4, "big"), hashlib.sha256)  # the length: no header/body boundary games
    mac.update(header)
    mac.update(body)
    return mac.digest()


class Link:
    """One end of one rank's connection: signs what this end sends, checks what it receives.

    ``me`` is ``"kernel"`` or ``"rank"``; ``rank`` and ``identity`` name the rank's connection (the kernel learns
    them from a hello: ``rank=None`` accepts the rank the first message names). ``open`` accepts a message only
    when its signature is the token's, its header names the other end, this rank and this identity, and its
    sequence number is above every one accepted before.
    """

    __slots__ = ("_key", "identity", "me", "rank", "seq_in", "seq_out")

    def __init__(self, key: bytes, *, me: str, rank: int | None, identity: str) -> None:
        if me not in _SENDERS:
            raise ValueError(f"Link me={me!r}: use 'kernel' or 'rank'")
        self._key, self.me, self.rank, self.identity = key, me, rank, identity
        self.seq_out = 0
        self.seq_in = 0

    def seal(self, body: bytes) -> list[bytes]:
        """``[signature, header, body]`` for one message body (``encode``'s bytes), with the next sequence number."""
        self.seq_out += 1
        header = (f'{{"from":"{self.me}","rank":{self.rank},"id":"{self.identity}",'
                  f'"seq":{self.seq_out}}}').encode()
        return [_mac(self._key, header, body), header, body]

    def open(self, frames: list[bytes]) -> dict[str, Any]:
        """The message in ``frames`` (as ``seal`` made them at the other end); raises ``Rejected`` saying why not."""
        if len(frames) != 3:
            raise Rejected(f"{len(frames)} frame(s), not [signature, header, body]: unsigned or malformed")
        signature, header_bytes, body = frames
        if not hmac.compare_digest(signature, _mac(self._key, header_bytes, body)):
            raise Rejected("bad signature (not signed with this kernel's token)")
        try:
            header = json.loads(header_bytes)
            sender, rank, identity, seq = header["from"], header["rank"], header["id"], header["seq"]
            message = decode(body)
        except (ValueError, KeyError, TypeError) as exc:
            raise Rejected(f"signed but unreadable: {exc}") from None
        if sender == self.me or sender not in _SENDERS:
            raise Rejected(f"header says it comes from {sender!r}, which cannot send to the {self.me}")
        if identity != self.identity:
            raise Rejected(f"signed for connection {identity!r}, arrived on {self.identity!r}")
        if self.rank is not None and rank != self.rank:
            raise Rejected(f"signed for rank {rank}, this connection is rank {self.rank}")
        if not isinstance(seq, int) or seq <= self.seq_in:
            raise Rejected(f"sequence number {seq} is not above {self.seq_in}: a replayed or reordered message")
        if self.rank is None:
            if not isinstance(rank, int):
                raise Rejected(f"header rank {rank!r} is not a rank")
            self.rank = rank
        self.seq_in = seq
        return message


def check_address(text: str) -> str:
    """``"tcp://host:port"`` -> itself; a clear error for anything else (a token after ``#`` included)."""
    address = text.strip()
    if "#" in address:
        raise ValueError(f"kernel address {address.split('#')[0]!r}#...: the token no longer goes into the address "
                         f"(it would end up in notebooks and in every process listing); give the address alone and "
                         f"the token through --token-file PATH, {ENV_TOKEN_FILE} or {ENV_TOKEN}")
    rest = address[len("tcp://"):]
    if not address.startswith("tcp://") or ":" not in rest or not rest.rpartition(":")[2].isdigit():
        raise ValueError(f"kernel address {address!r}: expected tcp://HOST:PORT, as %ranks_connect prints it")
    return address


def parse_listen(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` / ``":PORT"`` / ``"PORT"`` -> (host, port); the host defaults to loopback, port 0 is any."""
    host, sep, port = text.strip().rpartition(":")
    if not sep and not port.isdigit():
        host, port = port, "0"  # "node0": a host alone
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen {text!r}: expected HOST:PORT, :PORT or PORT with PORT 0-65535 (0: any free port)")
    return host, int(port)


def read_token(token_file: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    """The kernel's token for a joining rank: from ``token_file``, else ``$WORKBENCH_KERNEL_TOKEN``, else the file
    ``$WORKBENCH_KERNEL_TOKEN_FILE`` names. A file that others may read is refused (as ssh refuses such keys)."""
    path = token_file or (None if env.get(ENV_TOKEN) else env.get(ENV_TOKEN_FILE))
    if path is None:
        token = env.get(ENV_TOKEN, "").strip()
        if not token:
            raise ValueError(f"no kernel token: pass --token-file PATH (the file %ranks_connect names), or set "
                             f"{ENV_TOKEN_FILE}=PATH or {ENV_TOKEN} in the ranks' environment")
        return token
    try:
        mode = os.stat(path).st_mode & 0o777
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"kernel token file {path}: {exc.strerror or exc} (the kernel writes it when it starts; "
                         f"the ranks must see the same file, e.g. on a shared home directory)") from None
    if mode & 0o077:
        raise ValueError(f"kernel token file {path} has mode {mode:o}: others may read it; chmod 600 {path}")
    if not token:
        raise ValueError(f"kernel token file {path} is empty")
    return token


def write_token_file(path: str | Path, token: str) -> Path:
    """Write ``token`` to ``path`` with mode 0600 (atomically: a reader sees the old file or the whole new one)."""
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
