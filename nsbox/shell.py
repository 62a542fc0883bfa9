"""Interactive sessions: a shell on a pseudo-terminal inside the sandbox.

The terminal is allocated inside the sandbox: the init opens the sandbox's
own /dev/ptmx as the session's user and hands the master to us; the slave
becomes the shell's controlling terminal, so job control works. The host's
terminal never enters the sandbox (a sandboxed process holding it could
type into it with TIOCSTI); we relay bytes between it and the master, in
raw mode, and pass window size changes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import socket
import struct
import termios
import tty
from typing import Iterator, Sequence

from . import files, protocol
from .errors import SandboxUnavailable, UserUnsupported
from .fdwait import Poller
from .sandbox import Sandbox, _failed_start

TIOCGPTPEER = 0x5441  # open the slave of a master without a path lookup
TIOCSPTLCK = 0x40045431  # unlockpt


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _copy_window_size(src: int, dst: int) -> None:
    if os.isatty(src):
        size = fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(dst, termios.TIOCSWINSZ, size)


async def open_pty(sb: Sandbox, user: str | None) -> tuple[int, int]:
    """A new pty of the sandbox's devpts, owned by `user`: (master, slave)."""
    identity = await sb._identity_for(user)
    if identity is None:
        raise UserUnsupported(f"unable to find user {user}: no matching entries in passwd file")
    master, _ = await files.open_path(sb._send, sb._creds(identity), "/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)
    except OSError:
        os.close(master)
        raise
    return master, slave


async def interactive(sb: Sandbox, cmd: Sequence[str] | None = None, *, user: str | None = None,
                      stdin: int = 0, stdout: int = 1) -> int:
    """Runs `cmd` (default: the user's login shell) on a pty; returns its status."""
    identity = await sb._identity_for(user)
    if identity is None:
        raise UserUnsupported(f"unable to find user {user}: no matching entries in passwd file")
    argv = list(cmd) if cmd else [identity.shell or "/bin/sh", "-l"]
    master, slave = await open_pty(sb, user)
    env = {"TERM": os.environ.get("TERM", "xterm")}
    message, memfd, workdir = sb._exec_request(argv, identity, None, env, flags=protocol.F_SETCTTY)
    chan, chan_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _copy_window_size(stdin, master)
        try:
            await sb._send(message, [chan_child.fileno(), slave, slave, slave] + ([memfd] if memfd is not None else []))
        finally:
            chan_child.close()
            os.close(slave)
            if memfd is not None:
                os.close(memfd)
        with _raw_terminal(stdin):
            return await _relay(sb, chan, master, stdin, stdout, argv[0], workdir)
    finally:
        chan.close()
        os.close(master)


def _drain(master: int, stdout: int) -> bool:
    """Copies what the pty holds to stdout; False once its slave side is gone."""
    while True:
        try:
            data = os.read(master, 65536)
        except BlockingIOError:
            return True
        except OSError as e:
            if e.errno == errno.EIO:  # every slave descriptor is closed
                return False
            raise
        if not data:
            return False
        os.write(stdout, data)


async def _relay(sb: Sandbox, chan: socket.socket, master: int, stdin: int, stdout: int,
                 command: str, workdir: str) -> int:
    os.set_blocking(master, False)
    chan.setblocking(False)
    poller = Poller()
    loop = asyncio.get_running_loop()
    resizable = os.isatty(stdin)
    if resizable:
        loop.add_signal_handler(signal.SIGWINCH, _copy_window_size, stdin, master)
    replies = bytearray()
    code: int | None = None
    failure: protocol.Reply | None = None
    pending = b""  # input the pty has not taken yet (a large paste, say)
    stdin_open = master_open = True
    try:
        poller.watch(chan.fileno(), read=True)
        while code is None:
            # Read more input only once the pty has taken what we have.
            poller.watch(stdin, read=stdin_open and not pending)
            poller.watch(master, read=master_open, write=bool(pending))
            ready = await poller.wait()
            if stdin in ready:
                data = os.read(stdin, 4096)
                if not data:  # our input ended: end of file (^D) for the shell
                    stdin_open, data = False, b"\x04"
                pending += data
            if pending:
                try:
                    pending = pending[os.write(master, pending) :]
                except BlockingIOError:
                    pass
            if master in ready and master_open:
                master_open = _drain(master, stdout)
            if chan.fileno() in ready:
                try:
                    got = chan.recv(4096)
                except BlockingIOError:
                    continue
                if not got:
                    raise SandboxUnavailable(f"sandbox {sb.id} stopped during the session")
                replies += got
                for r in protocol.parse_replies(replies):
                    if r.kind == protocol.REPLY_EXIT:
                        code = r.code
                    elif r.kind == protocol.REPLY_FAIL:
                        failure = r
        _drain(master, stdout)  # what the shell printed last
    finally:
        poller.close()
        if resizable:
            loop.remove_signal_handler(signal.SIGWINCH)
    if failure is not None:
        result = _failed_start(failure, command, workdir)
        os.write(2, result.stderr.encode())
        return result.returncode
    return code
