"""The nsbox process's side of the network helper (nsbox/net/helper.py).

One helper per nsbox process, started on first use. Its channel is its
lifeline: when this process exits (or is killed), the helper stops every
program it started (pasta, slirp4netns) and exits.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import anyio

from ..errors import NsboxError
from ..host.fdpass import recv_fds

HELPER = Path(__file__).with_name("helper.py")
MAX_MESSAGE = 65536


class NetError(NsboxError):
    """A network operation failed."""


@dataclass(frozen=True)
class Namespaces:
    """Descriptors of a sandbox's network namespace and of the user namespace
    that owns it (None when this process may enter it without one: root).

    Open them from the sandbox init's pid with `Namespaces.of_pid` while the
    init is known to be alive (e.g. holding its pidfd); the descriptors then
    keep naming the same namespaces whatever happens to the pid.
    """

    net: int
    user: int | None

    @classmethod
    def of_pid(cls, pid: int, *, with_user: bool | None = None) -> "Namespaces":
        """with_user: join the user namespace too (default: unless root)."""
        if with_user is None:
            with_user = os.geteuid() != 0
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            user = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC) if with_user else None
        except BaseException:
            os.close(net)
            raise
        return cls(net, user)

    def close(self) -> None:
        os.close(self.net)
        if self.user is not None:
            os.close(self.user)


class NetHelper:
    """Requests to the helper process; one at a time (the helper is sequential).
    `NetHelper(chan)` speaks the same protocol over a given socket (a
    service network's bridge worker) and never starts a process."""

    def __init__(self, chan: socket.socket | None = None) -> None:
        self._fixed = chan is not None
        if chan is not None:
            chan.setblocking(False)
            _holding.add(self)
        self._chan: socket.socket | None = chan
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = anyio.Lock()
        self._seq = 0
        self._pid_at_start = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, os.fspath(HELPER), str(theirs.fileno())], stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()], close_fds=True, start_new_session=True,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self._chan = ours
        self._pid_at_start = os.getpid()
        _holding.add(self)
        return ours

    def _channel(self) -> socket.socket:
        if self._fixed:
            if self._chan is None:
                raise NetError("the network's worker has stopped")
            return self._chan
        return self._chan if self._chan is not None and self._pid_at_start == os.getpid() else self._start()

    async def request(self, op: str, fds: Sequence[int] = (), /, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """Sends one request; returns the reply and the descriptors it carries
        (the caller owns them). Raises NetError with the helper's message."""
        async with self._lock:
            chan = self._channel()
            self._seq += 1
            seq = self._seq
            data = json.dumps({"op": op, "seq": seq, **fields}).encode()
            while True:
                try:
                    socket.send_fds(chan, [data], list(fds)) if fds else chan.send(data)
                    break
                except BlockingIOError:
                    await anyio.wait_writable(chan)
                except OSError as e:
                    if e.errno in (errno.EPIPE, errno.ECONNRESET):
                        self._chan = None
                        raise NetError("the network helper process has exited") from None
                    raise
            while True:
                data, got = await receive(chan)
                if not data:
                    break
                answer = json.loads(data)
                if answer.pop("seq", None) == seq:
                    break
                for fd in got:  # the late reply of a request that was cancelled
                    os.close(fd)
        if not data:
            self._chan = None
            raise NetError("the network helper process has exited")
        if not answer.pop("ok"):
            for fd in got:
                os.close(fd)
            raise NetError(answer["error"])
        return answer, got

    def ended(self) -> bool:
        """Whether the other side closed the channel, without asking it (a
        bridge worker's channel is readable between requests only then)."""
        if self._chan is None:
            return True
        poll = select.poll()
        poll.register(self._chan, select.POLLIN)
        return bool(poll.poll(0))

    async def aclose(self) -> None:
        """Stops the helper and everything it started."""
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        if self._proc is not None:
            proc, self._proc = self._proc, None
            with anyio.CancelScope(shield=True):
                while proc.poll() is None:
                    await anyio.sleep(0.005)


async def receive(chan: socket.socket, maxfds: int = 16) -> tuple[bytes, list[int]]:
    """The next message on a non-blocking channel and its descriptors
    (b"" once the other side closed it)."""
    while True:
        await anyio.wait_readable(chan)
        try:
            return recv_fds(chan, MAX_MESSAGE, maxfds)
        except BlockingIOError:
            continue


_default: NetHelper | None = None
# Those holding a channel (to the helper, or to a bridge worker).
_holding: weakref.WeakSet[NetHelper] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A child forked without exec drops its parent's channels: the helper
    and bridge workers end with the parent (EOF), not with the child."""
    global _default
    for h in list(_holding):
        if h._chan is not None:
            h._chan.close()
            h._chan = None
        h._proc = None
    _holding.clear()
    _default = None


os.register_at_fork(after_in_child=_forget_in_child)


def helper() -> NetHelper:
    """This process's helper (started on the first request)."""
    global _default
    if _default is None:
        _default = NetHelper()
    return _default


def _ns_request(ns: Namespaces, *extra: int) -> tuple[list[int], dict[str, int | None]]:
    """Descriptors and index fields for a request acting inside `ns`;
    `extra` descriptors follow at indices 2, 3, ..."""
    fds = [ns.net, ns.user if ns.user is not None else ns.net, *extra]
    return fds, {"net_fd": 0, "user_fd": 1 if ns.user is not None else None}


async def listen_in(ns: Namespaces, host: str, port: int, *, via: NetHelper | None = None) -> socket.socket:
    """A TCP socket listening on host:port inside the namespace (its
    loopback must be up). Accept on it from this process: no process runs
    inside the sandbox for it."""
    fds, fields = _ns_request(ns)
    _, got = await (via or helper()).request("listen", fds, host=host, port=port, **fields)
    return socket.socket(fileno=got[0])


async def connect_in(ns: Namespaces, host: str, port: int, *, via: NetHelper | None = None,
                     timeout: float = 10.0) -> socket.socket:
    """A TCP connection to host:port made from inside the namespace."""
    fds, fields = _ns_request(ns)
    _, got = await (via or helper()).request("connect", fds, host=host, port=port, **fields)
    sock = socket.socket(fileno=got[0])
    try:
        with anyio.fail_after(timeout):
            await anyio.wait_writable(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise ConnectionRefusedError(err, f"connecting to {host}:{port} inside the sandbox: {os.strerror(err)}")
    except BaseException:
        sock.close()
        raise
    return sock
