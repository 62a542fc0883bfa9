"""InitClient: the one speaker of the init's protocol (csrc/common/protocol.h).

A sandbox's init listens on a control connection. Every request that starts
something (a command, a helper that opens a file) carries a *channel*: one
end of a fresh socketpair on which the init answers (STARTED, FAIL, EXIT or
FD records), to which the host writes a signal number to signal the
command's process tree, and whose early close kills that tree. This module
owns that exchange: encoding requests, passing descriptors, reading replies,
and turning the init's answers into results or exceptions, in one place.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import anyio

from . import protocol
from .._native import ffi, lib
from ..errors import NsboxError, SandboxUnavailable, UserUnsupported
from ..host import rlimits
from ..host.fdpass import recv_fds
from .fdwait import POLLERS

# PATH of every command that sets none: protocol.h's, the init's too.
DEFAULT_PATH: str = ffi.string(lib.nsbox_default_path()).decode()
# Longest wait for the init to say a command started, or to open a file:
# nothing the sandbox does may keep a host call waiting forever.
START_TIMEOUT = 30.0
OPEN_TIMEOUT = 30.0


@dataclass(frozen=True)
class ExecResult:
    """The result of Sandbox.exec: as Inspect's ExecResult, plus how many
    bytes of each stream front-truncation dropped (0: the whole output is
    there; otherwise `stdout`/`stderr` hold the last N bytes, N being the
    output limit of nsbox.init.output_limits)."""

    success: bool
    returncode: int
    stdout: str
    stderr: str
    stdout_truncated: int = 0
    stderr_truncated: int = 0

    @property
    def truncated(self) -> bool:
        """Whether either stream lost bytes to the output limit."""
        return bool(self.stdout_truncated or self.stderr_truncated)


@dataclass(frozen=True)
class Command:
    """A command for the init to start: everything already resolved."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str
    creds: protocol.Creds
    # A restart policy: protocol.F_RESTART[_ON_FAILURE], and the most restarts (0: any).
    restart_flags: int = 0
    restart_limit: int = 0


class Channel:
    """One request's channel, host side (non-blocking)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        if sock.getblocking():
            sock.setblocking(False)
        self._buf = bytearray()
        self._pending: list[protocol.Reply] = []  # read with an earlier one that next_reply() returned
        # What read_status() has heard so far.
        self.answered = False  # any reply (STARTED, FAIL or EXIT)
        self.returncode: int | None = None  # EXIT
        self.failure: protocol.Reply | None = None  # the first FAIL: the command did not start

    def fileno(self) -> int:
        return self.sock.fileno()

    def read_replies(self) -> tuple[list[protocol.Reply], bool]:
        """The replies that arrived, and whether the init closed the channel."""
        out, self._pending = self._pending, []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return out, False
            except ConnectionResetError:
                data = b""
            if not data:
                return out, True
            self._buf += data
            out += protocol.parse_replies(self._buf)

    def read_status(self) -> bool:
        """Reads the replies that arrived into answered, returncode and
        failure; returns whether the init closed the channel."""
        replies, closed = self.read_replies()
        for r in replies:
            self.answered = True
            if r.kind == protocol.REPLY_EXIT:
                self.returncode = r.code
            elif r.kind == protocol.REPLY_FAIL and self.failure is None:
                self.failure = r
        return closed

    async def next_reply(self, timeout: float) -> protocol.Reply | None:
        """The first reply, or None if the channel closed before one came;
        TimeoutError after `timeout` seconds."""
        if self._pending:
            return self._pending.pop(0)
        with anyio.fail_after(timeout):
            while True:
                await anyio.wait_readable(self.sock)
                replies, closed = self.read_replies()
                if replies:
                    self._pending = replies[1:]  # a quick command's EXIT comes with its STARTED
                    return replies[0]
                if closed:
                    return None

    def signal(self, sig: int) -> None:
        try:
            self.sock.send(protocol.SIGNAL.pack(sig))
        except OSError:
            pass  # the init is gone or the command already reported

    def close(self) -> None:
        self.sock.close()


class InitClient:
    """A connection to one sandbox's init, through its listening socket.

    The connection is opened on first use and closed once no request used it
    for IDLE_CLOSE seconds (the sandbox lives on: its lifeline is a pipe of
    the owning process, nsbox/create/lifeline.py), so that an idle sandbox
    holds no descriptor in this process; the next request reopens it.
    """

    def __init__(self, path: str, sandbox_id: str) -> None:
        self.path = path
        self.sandbox_id = sandbox_id
        self._ctl: socket.socket | None = None
        self._busy = 0  # exchanges under way on the connection: not idle
        self._dropped: list[socket.socket] = []  # connections the init closed, still in use
        self._closed = False
        # anyio lets one task at a time wait on a socket: senders that find
        # the connection full take turns, as do control exchanges.
        self._room_wait = anyio.Lock()
        self._control_turn = anyio.Lock()
        self.pollers = POLLERS  # for this sandbox's execs (shared: idle epolls are no sandbox's)

    @classmethod
    def connect(cls, path: str, sandbox_id: str) -> "InitClient":
        """A client of a sandbox another process created, connected now so
        that a sandbox that is gone is known at once (OSError)."""
        client = cls(path, sandbox_id)
        client._connect()
        return client

    @property
    def ctl(self) -> socket.socket:
        """The connection, opened if need be (SandboxUnavailable if the init
        is gone)."""
        with IDLE.lock:
            return self._open()

    def _open(self) -> socket.socket:
        if self._ctl is None:
            if self._closed:
                raise SandboxUnavailable(f"sandbox {self.sandbox_id} is closed")
            try:
                self._connect()
            except OSError as e:
                # Only an init that is not there; a limit of this process's
                # (EMFILE) is not the sandbox's end.
                if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ECONNRESET, errno.ENOTCONN):
                    raise self._gone() from None
                if e.errno == errno.EAGAIN:  # a Unix socket's full backlog: no wait, as TCP would
                    raise NsboxError(f"sandbox {self.sandbox_id} does not take more connections now "
                                     "(its init's backlog is full)") from None
                raise
        IDLE.used(self)
        return self._ctl  # type: ignore[return-value]

    def _hold(self) -> socket.socket:
        """The connection, counted in use until _let_go(): no idle sweep or
        shed, of any thread, closes it meanwhile."""
        with IDLE.lock:
            ctl = self._open()
            self._busy += 1
            return ctl

    def _let_go(self) -> None:
        with IDLE.lock:
            self._busy -= 1
            if not self._busy:
                for ctl in self._dropped:
                    ctl.close()
                self._dropped.clear()

    def _connect(self) -> None:
        try:
            ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or not IDLE.shed(len(IDLE) // 2 + 1):
                raise
            ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            # The init accepts at once; only a full backlog makes this wait.
            ctl.settimeout(START_TIMEOUT)
            ctl.connect(self.path)
            ctl.setblocking(False)
        except BaseException:
            ctl.close()
            raise
        self._ctl = ctl

    def disconnect(self) -> None:
        """Closes the connection (if open and not in use); the next request
        reopens it."""
        if self._ctl is not None and not self._busy:
            ctl, self._ctl = self._ctl, None
            ctl.close()

    @property
    def connected(self) -> bool:
        return self._ctl is not None

    def close(self) -> None:
        with IDLE.lock:
            self._closed = True
            IDLE.forget(self)
            ctl, self._ctl = self._ctl, None
        if ctl is not None:
            ctl.close()

    def _gone(self) -> SandboxUnavailable:
        return SandboxUnavailable(f"sandbox {self.sandbox_id} is not running (its init has exited)")

    async def send(self, message: bytes, fds: Sequence[int], *, again: bool = True) -> None:
        """Sends one request. The init may have closed the connection while
        it lives (one it turned away, out of descriptors): a send that
        failed so delivered nothing, and goes once more on a new connection
        (unless not `again`), whose connect says whether the init is there."""
        for last in (False, True) if again else (True,):
            ctl = self._hold()
            try:
                while True:
                    try:
                        protocol.send(ctl, message, fds)
                        return
                    except BlockingIOError:
                        pass
                    except OSError as e:
                        closed = e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
                        if last or not closed:
                            if closed:  # the next request connects again
                                self._drop(ctl)
                            raise self._send_failed(e) from None
                        break
                    async with self._room_wait:
                        await anyio.wait_writable(ctl)
            finally:
                self._let_go()
            self._drop(ctl)

    def _drop(self, ctl: socket.socket) -> None:
        """Forgets a connection the init closed: closed now, or once its
        other users let go of it (_let_go)."""
        with IDLE.lock:
            if self._ctl is ctl:
                self._ctl = None
                if self._busy:
                    self._dropped.append(ctl)
                else:
                    ctl.close()

    def _send_failed(self, e: OSError) -> OSError | NsboxError:
        if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
            return self._gone()
        return e

    async def _request(self, message: bytes, memfd: int | None, fds: Sequence[int],
                       channel: tuple[socket.socket, socket.socket] | None = None) -> Channel:
        """Sends a request with a fresh channel (or `channel`: ours, and the
        end the init gets) in front of `fds`; the init holds its own copies
        of the descriptors once this returns."""
        try:
            chan, chan_child = channel or socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except BaseException:
            if memfd is not None:
                os.close(memfd)
            raise
        try:
            await self.send(message, [chan_child.fileno(), *fds, *([memfd] if memfd is not None else [])])
        except BaseException:
            chan.close()
            raise
        finally:
            chan_child.close()
            if memfd is not None:
                os.close(memfd)
        return Channel(chan)

    async def start(self, cmd: Command, stdio: tuple[int, int, int], *, flags: int = 0,
                    channel: tuple[socket.socket, socket.socket] | None = None) -> Channel:
        """Asks the init to start `cmd` with these descriptors as its
        stdin, stdout and stderr; replies arrive on the returned channel."""
        strings = [os.fsencode(cmd.cwd), *map(os.fsencode, cmd.argv),
                   *(os.fsencode(f"{k}={v}") for k, v in cmd.env.items())]
        message, memfd = protocol.encode(protocol.OP_EXEC, cmd.creds, strings, argc=len(cmd.argv),
                                         envc=len(cmd.env), flags=flags | cmd.restart_flags,
                                         mode=cmd.restart_limit)
        return await self._request(message, memfd, stdio, channel)

    async def spawn(self, cmd: Command, devnull: int, *, watch: bool = False) -> Channel | None:
        """Starts `cmd` detached, its stdio on /dev/null: it runs on its own
        and a later exit is not reported. Returns once it runs. With
        `watch`, returns its channel, on which the init reports its exit
        while the channel is open (closing it does not kill the command)."""
        chan = await self.start(cmd, (devnull, devnull, devnull), flags=protocol.F_DETACHED)
        kept = False
        try:
            try:
                reply = await chan.next_reply(START_TIMEOUT)
            except TimeoutError:
                raise NsboxError(f"the sandbox did not start {cmd.argv[0]!r} within {START_TIMEOUT:g}s") from None
            if reply is None:
                raise SandboxUnavailable(f"sandbox {self.sandbox_id} stopped while starting {cmd.argv[0]!r}")
            if reply.kind == protocol.REPLY_FAIL:
                raise NsboxError(failed_start(reply, cmd.argv[0], cmd.cwd).stderr.strip())
            kept = watch
            return chan if watch else None
        finally:
            if not kept:
                chan.close()  # detached: the command does not die with it

    async def open(self, creds: protocol.Creds, path: str, open_flags: int, *, mode: int = 0o666,
                   mkdirs: bool = False, regular: bool = True) -> tuple[int, bool]:
        """Opens `path` (absolute, inside the sandbox) as `creds`; returns the
        descriptor and whether it is a directory.

        With `regular`, only a regular file or a directory is opened: the
        bytes of anything else (a FIFO, a socket, a device) are the
        sandbox's to withhold. Raises OSError subclasses naming the path;
        TimeoutError (an OSError) if the sandbox does not answer in time.
        """
        flags = (protocol.F_MKDIRS if mkdirs else 0) | (protocol.F_REGULAR if regular else 0)
        message, memfd = protocol.encode(protocol.OP_OPEN, creds, [os.fsencode(path)], flags=flags,
                                         open_flags=open_flags, mode=mode)
        chan = await self._request(message, memfd, [])
        data = b""
        received: list[int] = []
        try:
            # Closing the channel on expiry makes the init kill the helper.
            with anyio.move_on_after(OPEN_TIMEOUT) as waited:
                while len(data) < protocol.REPLY.size:
                    await anyio.wait_readable(chan.sock)
                    try:
                        chunk, fds_in = recv_fds(chan.sock, protocol.REPLY.size - len(data), 1)
                    except BlockingIOError:
                        continue
                    received += fds_in
                    if not chunk:
                        break
                    data += chunk
        finally:
            chan.close()
        if waited.cancelled_caught or len(data) < protocol.REPLY.size:
            for fd in received:
                os.close(fd)
            if waited.cancelled_caught:
                raise TimeoutError(errno.ETIMEDOUT, f"the sandbox did not open the file within {OPEN_TIMEOUT:g}s",
                                   path)
            raise SandboxUnavailable(f"sandbox {self.sandbox_id} stopped while opening {path}")
        reply = protocol.Reply(*protocol.REPLY.unpack(data))
        if reply.kind == protocol.REPLY_FD and received:
            return received[0], reply.code == 1
        for fd in received:
            os.close(fd)
        raise open_failure(reply, path, regular)

    async def _control(self, op: int) -> bytes:
        """A request answered on the control connection itself."""
        async with self._control_turn:
            ctl = self._hold()
            try:
                # The answer comes on this connection: not sent on another.
                await self.send(protocol.REQUEST.pack(op, *[0] * 9), [], again=False)
                with anyio.fail_after(START_TIMEOUT):
                    while True:
                        await anyio.wait_readable(ctl)
                        try:
                            data = ctl.recv(protocol.STATUS.size)
                        except BlockingIOError:
                            continue
                        except ConnectionResetError:
                            data = b""
                        if not data:
                            raise self._gone()
                        return data
            except BaseException:
                # Cancelled or timed out, its answer may still come: the next
                # request, on a new connection, must not read it as its own.
                self._drop(ctl)
                raise
            finally:
                self._let_go()

    async def status(self) -> dict[str, int]:
        """The init's counters (execs served, commands running) and whether
        commands start in a child sharing its memory (see csrc/init/main.c)."""
        return _status(await self._control(protocol.OP_STATUS))

    async def detach(self) -> None:
        """The sandbox stops dying with this process (its lifeline no longer holds)."""
        await self._control(protocol.OP_DETACH)

    def shutdown(self) -> None:
        """Asks the init to kill everything and exit (best effort, no wait)."""
        try:
            protocol.send(self.ctl, protocol.REQUEST.pack(protocol.OP_SHUTDOWN, *[0] * 9), [])
        except (OSError, NsboxError):
            pass


class IdleConnections:
    """The open control connections, oldest use first; each is closed once
    IDLE_CLOSE seconds pass without a request on it: by a timer on each
    asyncio event loop that used one; elsewhere (trio, which has no loop
    timer to lend) by the process's next request after that.

    Sandboxes may be used from several threads, each with its loop: `lock`
    guards the registry and every open, close and in-use count of a
    connection (InitClient._hold)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entered: a connect that meets EMFILE sheds
        self._last: dict[InitClient, float] = {}  # insertion order: oldest use first
        self._armed: set[asyncio.AbstractEventLoop] = set()  # loops with a timer pending

    def __len__(self) -> int:
        return len(self._last)

    def used(self, client: InitClient) -> None:
        """(Under `lock`.) `client` was used now."""
        last = self._last
        new = last.pop(client, None) is None
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            loop = None
        if loop is None:
            self.sweep()
        elif loop not in self._armed:
            self._arm(loop, IDLE_CLOSE)
        if new:
            cap = rlimits.descriptor_share()
            if len(last) >= cap:
                self.shed(len(last) - cap + 1)
        last[client] = time.monotonic()

    def _arm(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        # A closed loop's timer never fires: forget such loops as others come.
        self._armed = {armed for armed in self._armed if not armed.is_closed()}
        self._armed.add(loop)
        loop.call_later(delay, self._fire, loop)

    def shed(self, count: int) -> int:
        """Closes up to `count` connections, the least recently used first,
        however recently: a burst over many sandboxes must not use up this
        process's descriptors. Returns how many it closed."""
        closed = 0
        with self.lock:
            for client in list(self._last):
                if closed >= count:
                    break
                if not client._busy:
                    del self._last[client]
                    client.disconnect()
                    closed += 1
        return closed

    def forget(self, client: InitClient) -> None:
        with self.lock:
            self._last.pop(client, None)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            self._armed.discard(loop)
            self.sweep()
            if self._last:  # look again when the oldest is due
                oldest = next(iter(self._last.values()))
                self._arm(loop, max(0.05, oldest + IDLE_CLOSE - time.monotonic()))

    def sweep(self) -> None:
        """Closes the connections idle for IDLE_CLOSE seconds or more."""
        limit = time.monotonic() - IDLE_CLOSE
        with self.lock:
            last = self._last
            for client, at in list(last.items()):
                if at > limit:
                    break
                del last[client]
                if client._busy:
                    last[client] = time.monotonic()  # in use: look again later
                else:
                    client.disconnect()

    def forget_in_child(self) -> None:
        """A child forked without exec: a fresh lock (another thread may have
        held this one at the fork), and none of its parent's connections
        (a request of the child's must not interleave with its parent's on
        them: the child's next request opens its own)."""
        self.lock = threading.RLock()
        for client in list(self._last):
            if client._ctl is not None:
                client._ctl.close()
                client._ctl = None
            client._busy = 0
        self._last.clear()
        self._armed.clear()


# Seconds a control connection stays open after its last request: long
# enough for a burst of execs to share it, short enough that idle sandboxes
# hold no descriptor.
IDLE_CLOSE = 2.0
IDLE = IdleConnections()
os.register_at_fork(after_in_child=IDLE.forget_in_child)


def query_status(path: str, timeout: float = 1.0) -> dict[str, int] | None:
    """The counters of the init listening on the socket at `path`, from a
    process that does not own it (`nsbox ps`); None if it does not answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.send(protocol.REQUEST.pack(protocol.OP_STATUS, *[0] * 9))
            return _status(s.recv(protocol.STATUS.size))
    except (OSError, ValueError, struct.error):
        return None


def _status(data: bytes) -> dict[str, int]:
    _, running, execs, detached, flags = protocol.STATUS.unpack(data)
    return {"running": running, "execs": execs, "detached": detached,
            "shared_spawn": int(bool(flags & protocol.STATUS_SHARED_SPAWN))}


_OPEN_STAGES = {
    protocol.STAGE_MKDIRS: "creating its parent directories failed",
    protocol.STAGE_CREDS: "switching to the sandbox user failed",
    protocol.STAGE_SPAWN: "the sandbox could not fork",
    protocol.STAGE_REQUEST: "the sandbox rejected the request",
    protocol.STAGE_HELPER: "a process inside the sandbox stopped or killed nsbox's helper",
}


def open_failure(reply: protocol.Reply, path: str, regular: bool) -> OSError:
    """The exception for an OPEN the init refused."""
    err = reply.err or errno.EIO
    if reply.stage == protocol.STAGE_OPEN and err == errno.EINVAL and regular:
        return OSError(errno.EINVAL, "Not a regular file", path)
    if reply.stage == protocol.STAGE_KERNEL_FS:
        return PermissionError(err, "A file of a kernel file system (/proc, /sys, cgroups) or of FUSE: "
                                    "read or write it with a command (exec)", path)
    words = _OPEN_STAGES.get(reply.stage)
    return OSError(err, os.strerror(err) + (f" ({words})" if words else ""), path)


def failed_start(failure: protocol.Reply, command: str, workdir: str) -> ExecResult:
    """The result (or exception) for a command the init could not start."""
    err = failure.err
    reason = os.strerror(err)
    if failure.stage == protocol.STAGE_EXEC:
        if err == errno.EACCES:
            raise PermissionError(err, f"{reason}: cannot execute", command)
        if err in (errno.ENOENT, errno.ENOTDIR):
            text = "command not found" if "/" not in command else reason
            return ExecResult(False, 127, "", f"nsbox: {command}: {text}\n")
        return ExecResult(False, 126, "", f"nsbox: {command}: {reason}\n")
    if failure.stage == protocol.STAGE_CWD:
        if err == errno.EACCES:
            raise PermissionError(err, f"{reason}: cannot change to the working directory", workdir)
        return ExecResult(False, 126, "", f"nsbox: cannot change to the working directory {workdir}: {reason}\n")
    if failure.stage == protocol.STAGE_CREDS:
        raise UserUnsupported(f"switching to the requested user failed: {reason}")
    if failure.stage == protocol.STAGE_HELPER:
        if err == errno.ETIMEDOUT:
            raise NsboxError(f"nsbox's helper starting {command!r} was stuck (in the kernel, on a file system "
                             f"that does not answer, say) and was killed")
        raise NsboxError(f"a process inside the sandbox stopped or killed nsbox's helper while it was "
                         f"starting {command!r}; the helper was killed")
    if failure.stage == protocol.STAGE_SPAWN and err in (errno.EAGAIN, errno.ENOMEM):
        # The sandbox's own processes or memory are used up (pids_limit,
        # memory): the command's failure, which its caller (a model) can
        # read and act on, as Docker reports a fork that fails in its exec.
        return ExecResult(False, 126, "", f"nsbox: cannot start {command}: {reason} (the sandbox's "
                                          f"{'process' if err == errno.EAGAIN else 'memory'} limit may be reached)\n")
    raise NsboxError(f"the sandbox could not start {command!r}: {reason}")
