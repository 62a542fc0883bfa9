"""The host side of a running command: its output, its stdin, its exit.

A Pump watches up to four descriptors in one coroutine: stdout and stderr
(pipes the command writes to directly), stdin (a pipe we feed the initial
input into) and the command's channel (see nsbox/init/client.py), on which
the init reports the exit status and to which we write a signal number to
kill the command's process tree. Output goes into a sink per stream: exec
collects it (nsbox/init/process.py), start_process queues it for its
consumer (nsbox/init/streaming.py); both read through drain().
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import signal
from typing import Callable, Protocol

import anyio.lowlevel

from .capture import READ_CHUNK
from .client import Channel
from .fdwait import Poller, PollerPool

BIG_PIPE = 1 << 20
# Most bytes taken from one stream per wakeup, so a flood cannot starve
# the event loop (or this command's own timeout).
DRAIN_BUDGET = 4 * 1024 * 1024
# After the command exits, background processes it started may still hold
# its stdout: keep reading this long, then return without them.
EXIT_GRACE = 0.1
# After a kill, how long to wait for the init to confirm the exit.
KILL_WAIT = 5.0


class OutputSink(Protocol):
    """Where one output stream goes (nsbox/init/capture.py has exec's)."""

    total: int  # bytes read so far

    def read_from(self, fd: int) -> int:
        """Reads once from `fd`; the byte count, 0 at EOF; raises
        BlockingIOError when nothing is available."""
        ...


class Pump:
    """Moves one command's bytes until it has exited and its output is read.

    Owns the channel, the output descriptors and, unless `keep_stdin`, the
    stdin pipe; close() releases them. The channel's returncode and failure
    say how the command ended; `lost` that the channel closed without an
    exit report, `timed_out` and `overflowed` that run() killed it.
    """

    __slots__ = ("chan", "streams", "stdin", "keep_stdin", "pending", "pool", "on_input_done", "lost", "timed_out",
                 "overflowed")

    def __init__(self, streams: dict[int, OutputSink], input: bytes | None = None, *, stdin: int = -1,
                 keep_stdin: bool = False, pool: PollerPool | None = None,
                 on_input_done: Callable[[], None] | None = None) -> None:
        self.chan: Channel | None = None  # set once the init has the request
        self.streams = streams  # output descriptors still open, non-blocking
        self.stdin = stdin  # the pipe `input` goes into (-1: none); closed once fed unless keep_stdin
        self.keep_stdin = keep_stdin  # after `input`, stdin stays open for the owner
        self.pending: bytes | memoryview = input or b""  # input not written yet
        self.pool = pool
        self.on_input_done = on_input_done
        self.lost = False
        self.timed_out = False
        self.overflowed = False

    async def run(self, timeout: float | None = None, stop_on_overflow: bool = False,
                  on_news: Callable[[], None] | None = None) -> None:
        """Pumps until the command has exited and its output is read (or
        EXIT_GRACE after the exit), or the channel is lost. After `timeout`,
        or once a sink is truncated with `stop_on_overflow`, kills the
        command and waits KILL_WAIT at most for the exit. `on_news` is
        called after each batch of reads."""
        chan, streams = self.chan, self.streams
        assert chan is not None
        chan_fd = chan.fileno()
        poller = Poller(self.pool)
        try:
            for fd in streams:
                poller.want_read(fd)
            poller.want_read(chan_fd)
            stdin = self.stdin
            if stdin >= 0 and self.pending:
                self.pending = memoryview(self.pending)
                os.set_blocking(stdin, False)
                poller.want_write(stdin)
            else:
                self._input_done()  # no input: the command reads EOF at once
                stdin = -1

            now = poller.now()
            deadline = now + timeout if timeout is not None else math.inf
            while True:
                if chan.returncode is not None and not streams:
                    return
                now = poller.now()
                if now >= deadline:
                    if chan.returncode is not None or self.timed_out or self.overflowed:
                        return  # grace after exit, or the kill went unanswered
                    self.timed_out = True
                    chan.signal(signal.SIGKILL)
                    deadline = now + KILL_WAIT
                    continue
                ready = await poller.wait(None if deadline == math.inf else deadline - now)
                busy = False  # a stream had more than its budget: others get the loop before the next read
                for fd in ready:
                    if fd in streams:
                        sink = streams[fd]
                        before = sink.total
                        if drain(fd, sink):
                            poller.forget(fd)
                            del streams[fd]
                            os.close(fd)
                        else:
                            busy = busy or sink.total - before >= budget(sink)
                        if stop_on_overflow and sink.truncated and not self.overflowed:  # type: ignore[attr-defined]
                            # Stop reading, kill, and wait (bounded) for the exit,
                            # so that the command is gone when the caller sees the error.
                            self.overflowed = True
                            chan.signal(signal.SIGKILL)
                            for f in list(streams):
                                poller.forget(f)
                                del streams[f]
                                os.close(f)
                            deadline = now + KILL_WAIT
                            break
                    elif fd == chan_fd:
                        if chan.read_status():
                            poller.forget(chan_fd)
                            if chan.returncode is None:
                                # Closed after a failure report (e.g. fork failed),
                                # or the sandbox stopped: the failure says which.
                                self.lost = True
                                return
                        if chan.returncode is not None and deadline > poller.now() + EXIT_GRACE:
                            deadline = poller.now() + EXIT_GRACE
                    elif fd == stdin:
                        self.pending = feed(stdin, self.pending)  # type: ignore[arg-type]
                        if not self.pending:
                            poller.forget(stdin)
                            self._input_done()
                            stdin = -1
                if on_news is not None:
                    on_news()
                if busy:
                    # The poller answers at once while output waits: a command
                    # that writes without end would have had the loop to itself.
                    await anyio.lowlevel.checkpoint()
        finally:
            poller.close()

    def _input_done(self) -> None:
        self.pending = b""
        if not self.keep_stdin:
            fd, self.stdin = self.stdin, -1
            if fd >= 0:
                os.close(fd)
        if self.on_input_done is not None:
            self.on_input_done()

    def close(self) -> None:
        """Closes what the pump owns (idempotent). Closing the channel
        before the exit was reported makes the init kill the command's tree
        (cancellation, overflow, a kill that went unanswered, errors)."""
        if self.chan is not None:
            self.chan.close()
        fds = list(self.streams)
        self.streams.clear()
        if not self.keep_stdin and self.stdin >= 0:
            fds.append(self.stdin)
            self.stdin = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def budget(sink: OutputSink) -> int:
    """What drain() reads at most at once: the sink's own `drain_budget`, if
    it has one, else DRAIN_BUDGET."""
    return getattr(sink, "drain_budget", DRAIN_BUDGET)


def drain(fd: int, sink: OutputSink) -> bool:
    """Reads what is available, up to the sink's budget(); True at EOF."""
    taken = 0
    most = budget(sink)
    while taken < most:
        try:
            n = sink.read_from(fd)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno == errno.EIO:  # a pty master whose slave descriptors are all closed
                return True
            raise
        if n == 0:
            return True
        if taken == 0 and n == READ_CHUNK and sink.total == n:
            grow_pipe(fd)
        taken += n
    return False


def grow_pipe(fd: int) -> None:
    """Makes pipe `fd` BIG_PIPE long, for a stream that is likely to be
    large: a bigger pipe saves a context switch per 64 KiB. Here, a command
    whose first write fills a read; small outputs keep the default, so many
    concurrent commands do not use up the per-user pipe allowance
    (fs.pipe-user-pages-soft)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, BIG_PIPE)
    except OSError:
        pass  # over the allowance, or not a pipe: the default works too


def feed(fd: int, pending: memoryview) -> memoryview:
    """Writes as much input as the pipe takes; empty when done or refused."""
    while pending:
        try:
            pending = pending[os.write(fd, pending[:1 << 20]) :]
        except BlockingIOError:
            return pending
        except (BrokenPipeError, ConnectionResetError):
            return memoryview(b"")  # the command stopped reading; not an error
    return pending
