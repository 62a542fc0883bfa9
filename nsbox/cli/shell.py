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
import fcntl
import math
import os
import signal
import struct
import termios
import tty
from typing import Iterator, Sequence

import anyio

from ..init import protocol
from ..init.capture import Forwarder
from ..init.client import Channel, Command, failed_start
from ..errors import NsboxError, SandboxUnavailable
from ..init.fdwait import Poller
from ..init.pump import drain
from ..sandbox import Sandbox
from ..init.users import Identity

TIOCGPTPEER = 0x5441  # open the slave of a master without a path lookup
TIOCSPTLCK = 0x40045431  # unlockpt
EOF_RETRY = 0.3  # seconds of silence after our input ended before another ^D


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


class _WindowSize:
    """Passes the host terminal's window size on to the pty, when it changed."""

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.resizable = os.isatty(src)
        self.copied = b""

    def sync(self) -> None:
        if self.resizable:
            size = fcntl.ioctl(self.src, termios.TIOCGWINSZ, b"\0" * 8)
            if size != self.copied:
                fcntl.ioctl(self.dst, termios.TIOCSWINSZ, size)
                self.copied = size


async def open_pty(sb: Sandbox, identity: Identity) -> tuple[int, int]:
    """A new pty of the sandbox's devpts, owned by `identity`: (master, slave)."""
    creds = protocol.Creds(identity.uid, identity.gid, identity.groups)
    try:
        master, _ = await sb.client.open(creds, "/dev/ptmx", os.O_RDWR | os.O_NOCTTY, regular=False)
    except OSError as e:  # the sandbox removed or replaced it: it is sandbox root's
        raise NsboxError(f"cannot open a pseudo-terminal in sandbox {sb.id}: /dev/ptmx: {e.strerror}") from None
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)
    except OSError as e:
        os.close(master)
        raise NsboxError(f"cannot open a pseudo-terminal in sandbox {sb.id}: /dev/ptmx is not one "
                         f"({e.strerror})") from None
    return master, slave


def _login_shell(shell: str | None) -> str:
    """The user's shell, or /bin/sh for accounts whose shell refuses logins
    (nologin, false), as `docker exec -it -u nobody C sh` would give."""
    if not shell or os.path.basename(shell) in ("nologin", "false"):
        return "/bin/sh"
    return shell


async def interactive(sb: Sandbox, cmd: Sequence[str] | None = None, *, user: str | None = None,
                      stdin: int = 0, stdout: int = 1) -> int:
    """Runs `cmd` (default: the user's login shell) on a pty; returns its status."""
    identity = await sb.identity(user)
    command = sb.command(list(cmd) if cmd else [_login_shell(identity.shell), "-l"], identity,
                         env={"TERM": os.environ.get("TERM", "xterm")})
    master, slave = await open_pty(sb, identity)
    chan: Channel | None = None
    try:
        window = _WindowSize(stdin, master)
        window.sync()
        try:
            chan = await sb.client.start(command, (slave, slave, slave), flags=protocol.F_SETCTTY)
        finally:
            os.close(slave)
        with _raw_terminal(stdin):
            return await _relay(sb, chan, master, stdin, stdout, command, window)
    finally:
        if chan is not None:
            chan.close()
        os.close(master)


async def _relay(sb: Sandbox, chan: Channel, master: int, stdin: int, stdout: int, command: Command,
                 window: _WindowSize) -> int:
    os.set_blocking(master, False)
    poller = Poller()
    loop = asyncio.get_running_loop()
    resizable = window.resizable
    if resizable:
        loop.add_signal_handler(signal.SIGWINCH, window.sync)
    output = Forwarder(stdout)
    pending = b""  # input the pty has not taken yet (a large paste, say)
    stdin_open = master_open = True
    # After our input ends, a shell that has gone quiet waits for more: an
    # end of file typed while it switched its terminal modes may have been
    # lost, so it gets another, a few times at most.
    eofs_left = 5
    try:
        poller.watch(chan.fileno(), read=True)
        while chan.returncode is None:
            # Read more input only once the pty has taken what we have.
            poller.watch(stdin, read=stdin_open and not pending)
            poller.watch(master, read=master_open, write=bool(pending))
            ready: set[int] = set()
            with anyio.move_on_after(math.inf if stdin_open or not eofs_left else EOF_RETRY):
                ready = await poller.wait()
            if not ready and not pending:
                eofs_left -= 1
                pending = b"\x04"
            if stdin in ready:
                # What is typed after a resize must find the new size, though
                # the SIGWINCH that says so may not have been handled yet.
                window.sync()
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
                # EOF (EIO) once every slave descriptor is closed
                master_open = not drain(master, output)
            if chan.fileno() in ready:
                if chan.read_status() and chan.returncode is None:
                    raise SandboxUnavailable(f"sandbox {sb.id} stopped during the session")
        drain(master, output)  # what the shell printed last
    finally:
        poller.close()
        if resizable:
            loop.remove_signal_handler(signal.SIGWINCH)
    if chan.failure is not None:
        result = failed_start(chan.failure, command.argv[0], command.cwd)
        os.write(2, result.stderr.encode())
        return result.returncode
    return chan.returncode
