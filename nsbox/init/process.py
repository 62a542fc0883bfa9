"""Running one command in a sandbox: its streams, stdin, timeout and exit.

The host side of an exec is one coroutine watching up to four descriptors:
stdout and stderr (pipes the command writes to directly), stdin (a pipe we
feed `input` into) and the command's channel (see nsbox/init/client.py), on
which the init reports the exit status and to which we write a signal
number to kill the command's process tree.
"""

from __future__ import annotations

import fcntl
import math
import os
import signal
from dataclasses import dataclass

from . import execfds, protocol
from .capture import READ_CHUNK, Sink
from .client import Channel, Command, InitClient
from .fdwait import Poller, PollerPool

BIG_PIPE = 1 << 20
# Most bytes taken from one stream per wakeup, so a flood cannot starve
# the event loop (or this exec's own timeout).
DRAIN_BUDGET = 4 * 1024 * 1024
# After the command exits, background processes it started may still hold
# its stdout: keep reading this long, then return without them.
EXIT_GRACE = 0.1
# After a timeout kill, how long to wait for the init to confirm the exit.
KILL_WAIT = 5.0



@dataclass
class Outcome:
    """What happened to one command, before any interpretation."""

    returncode: int | None  # None: the command never reported an exit
    stdout: Sink
    stderr: Sink
    failure: protocol.Reply | None  # the init could not start the command
    timed_out: bool = False
    overflowed: bool = False  # a stream passed the limit in "raise" mode
    channel_lost: bool = False  # the channel closed without an exit report


async def run(
    client: InitClient,
    cmd: Command,
    *,
    input: bytes | None,
    timeout: float | None,
    stdout: Sink,
    stderr: Sink,
    stop_on_overflow: bool,
    stdin_fd: int,
    flags: int = 0,
) -> Outcome:
    """Starts `cmd` and waits for it.

    The command reads `input` through a pipe or, when input is None,
    straight from `stdin_fd` (/dev/null, or a non-terminal host stdin).
    """
    outcome = Outcome(None, stdout, stderr, None)
    fds = execfds.take()
    to_close = [fds.out_r, fds.err_r]  # host ends, closed at the very end
    chan: Channel | None = None
    in_r, in_w = stdin_fd, -1
    try:
        try:
            if input is not None:
                in_r, in_w = os.pipe()
                to_close.append(in_w)
            # No STARTED: we wait for EXIT (or FAIL), and a reply we would
            # only discard costs a wakeup on each side.
            chan = await client.start(cmd, (in_r, fds.out_w, fds.err_w), flags=flags | protocol.F_NO_STARTED,
                                      channel=(fds.chan, fds.chan_child))
        finally:
            # The init holds its own copies now (or never will).
            fds.close_child_ends()
            if in_w >= 0:
                os.close(in_r)
            if chan is None:
                fds.chan.close()
        execfds.restock()  # for the next exec, while the init starts this one
        await _drive(client.pollers, chan, fds.out_r, fds.err_r, in_w, input, to_close, outcome, timeout,
                     stop_on_overflow)
        return outcome
    finally:
        # Closing the channel before the exit was reported makes the init
        # kill the command's tree (cancellation, overflow, errors).
        if chan is not None:
            chan.close()
        for fd in to_close:
            try:
                os.close(fd)
            except OSError:
                pass


async def _drive(
    pollers: PollerPool,
    chan: Channel,
    out_r: int,
    err_r: int,
    in_w: int,
    input: bytes | None,
    to_close: list[int],
    outcome: Outcome,
    timeout: float | None,
    stop_on_overflow: bool,
) -> None:
    streams: dict[int, Sink] = {out_r: outcome.stdout, err_r: outcome.stderr}
    chan_fd = chan.fileno()
    pending = memoryview(input) if input else memoryview(b"")
    poller = Poller(pollers)
    try:
        for fd in streams:  # non-blocking already (nsbox/init/execfds.py)
            poller.want_read(fd)
        poller.want_read(chan_fd)
        if in_w >= 0:
            if pending:
                os.set_blocking(in_w, False)
                poller.want_write(in_w)
            else:
                _close(in_w, to_close)  # empty input: the command reads EOF at once
                in_w = -1

        now = poller.now()
        deadline = now + timeout if timeout is not None else math.inf
        while True:
            if outcome.returncode is not None and not streams:
                return
            now = poller.now()
            if now >= deadline:
                if outcome.returncode is not None or outcome.timed_out or outcome.overflowed:
                    return  # grace after exit, or the kill went unanswered
                outcome.timed_out = True
                chan.signal(signal.SIGKILL)
                deadline = now + KILL_WAIT
                continue
            ready = await poller.wait(None if deadline == math.inf else deadline - now)
            for fd in ready:
                if fd in streams:
                    buf = streams[fd]
                    if _drain(fd, buf):
                        poller.forget(fd)
                        _close(fd, to_close)
                        del streams[fd]
                    if stop_on_overflow and buf.truncated and not outcome.overflowed:
                        # Stop reading, kill, and wait (bounded) for the exit,
                        # so that the command is gone when the caller sees the error.
                        outcome.overflowed = True
                        chan.signal(signal.SIGKILL)
                        for f in list(streams):
                            poller.forget(f)
                            _close(f, to_close)
                        streams.clear()
                        deadline = now + KILL_WAIT
                        break
                elif fd == chan_fd:
                    replies, closed = chan.read_replies()
                    for r in replies:
                        if r.kind == protocol.REPLY_EXIT:
                            outcome.returncode = r.code
                        elif r.kind == protocol.REPLY_FAIL and outcome.failure is None:
                            outcome.failure = r
                    if closed:
                        poller.forget(chan_fd)
                        if outcome.returncode is None:
                            # Closed after a failure report (e.g. fork failed):
                            # the sandbox lives on; the failure says why.
                            outcome.channel_lost = outcome.failure is None
                            return
                    if outcome.returncode is not None and deadline > poller.now() + EXIT_GRACE:
                        deadline = poller.now() + EXIT_GRACE
                elif fd == in_w:
                    pending = _feed(in_w, pending)
                    if not pending:
                        poller.forget(in_w)
                        _close(in_w, to_close)
                        in_w = -1
    finally:
        poller.close()


def _drain(fd: int, buf: Sink) -> bool:
    """Reads what is available, up to DRAIN_BUDGET; True at EOF."""
    taken = 0
    while taken < DRAIN_BUDGET:
        try:
            n = buf.read_from(fd)
        except BlockingIOError:
            return False
        if n == 0:
            return True
        if taken == 0 and n == READ_CHUNK and buf.total == n:
            _grow_pipe(fd)
        taken += n
    return False


def _grow_pipe(fd: int) -> None:
    """A command whose first write fills a read is likely to write a lot:
    a bigger pipe saves a context switch per 64 KiB. Small outputs keep the
    default, so many concurrent commands do not use up the per-user pipe
    allowance (fs.pipe-user-pages-soft)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, BIG_PIPE)
    except OSError:
        pass  # over the allowance, or not a pipe: the default works too


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Writes as much input as the pipe takes; empty when done or refused."""
    while pending:
        try:
            pending = pending[os.write(fd, pending[:1 << 20]) :]
        except BlockingIOError:
            return pending
        except (BrokenPipeError, ConnectionResetError):
            return memoryview(b"")  # the command stopped reading; not an error
    return pending


def _close(fd: int, to_close: list[int]) -> None:
    to_close.remove(fd)
    os.close(fd)
