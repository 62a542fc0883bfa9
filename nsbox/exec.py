"""Running one command in a sandbox: request, capped readers, stdin, timeout.

The host side of an exec is one coroutine watching up to four descriptors:
stdout and stderr (pipes the command writes to directly), stdin (a pipe we
feed `input` into) and the reply channel, on which the init reports the
command's exit status and to which we write a signal number to kill the
command's process tree.

Each output stream keeps only its last `limit` bytes (front-truncation), in
a ring buffer allocated once the output outgrows one read. Whatever the
command writes, the host holds at most limit + one read chunk per stream.
"""

from __future__ import annotations

import fcntl
import math
import os
import select
import signal
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import anyio

from . import protocol
from .fdwait import Poller

READ_CHUNK = 65536
BIG_PIPE = 1 << 20
# Most bytes taken from one stream per wakeup, so a flood cannot starve
# the event loop (or this exec's own timeout).
DRAIN_BUDGET = 4 * 1024 * 1024
# After the command exits, background processes it started may still hold
# its stdout: keep reading this long, then return without them.
EXIT_GRACE = 0.1
# After a timeout kill, how long to wait for the init to confirm the exit.
KILL_WAIT = 5.0


# Rings of finished commands, kept for the next ones: a fresh 10 MiB buffer
# costs a page fault per 4 KiB on every exec, which made large captures
# slow. At most SPARE_RINGS are kept.
SPARE_RINGS = 2
_spare_rings: list[bytearray] = []


def _get_ring(size: int) -> bytearray:
    for i, ring in enumerate(_spare_rings):
        if len(ring) == size:
            return _spare_rings.pop(i)
    return bytearray(size)


def _put_ring(ring: bytearray) -> None:
    if len(_spare_rings) < SPARE_RINGS:
        _spare_rings.append(ring)


class CappedBuffer:
    """Keeps the last `limit` bytes written into it, and counts them all.

    Output that fits one read stays in that chunk; more moves into a ring of
    exactly `limit` bytes that reads land in directly (no copy), so a stream
    costs at most limit + one chunk of memory whatever the command writes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._chunks: list[bytes] = []
        self._ring: bytearray | None = None
        self._view: memoryview | None = None
        self._pos = 0  # next write position in the ring
        self._filled = 0  # valid bytes in the ring

    def read_from(self, fd: int) -> int:
        """Reads once from `fd`; returns the byte count, 0 at EOF.

        Raises BlockingIOError when nothing is available.
        """
        if self._view is None:
            data = os.read(fd, READ_CHUNK)
            if data:
                self.total += len(data)
                self._chunks.append(data)
                if self.total > min(self.limit, READ_CHUNK):
                    self._start_ring()
            return len(data)
        view, pos = self._view, self._pos
        n = os.readv(fd, [view[pos:], view[:pos]])
        if n:
            self.total += n
            self._pos = (pos + n) % self.limit
            self._filled = min(self.limit, self._filled + n)
        return n

    def _start_ring(self) -> None:
        data = b"".join(self._chunks)[-self.limit :]
        self._chunks = []
        self._ring = _get_ring(self.limit)
        self._ring[: len(data)] = data
        self._view = memoryview(self._ring)
        self._filled = len(data)
        self._pos = len(data) % self.limit

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def _pieces(self) -> list[bytes | memoryview]:
        """The kept bytes, oldest first, without copying them."""
        if self._view is None:
            return [b"".join(self._chunks)[-self.limit :] if self.limit else b""]
        if self._filled < self.limit or self._pos == 0:
            return [self._view[: self._filled]]
        return [self._view[self._pos :], self._view[: self._pos]]

    def _release(self) -> None:
        if self._view is not None:
            self._view.release()
            assert self._ring is not None
            _put_ring(self._ring)
        self._chunks, self._ring, self._view = [], None, None

    def take(self) -> bytes:
        """Returns the kept bytes and releases the buffer."""
        data = b"".join(self._pieces())
        self._release()
        return data

    def _unwrap(self) -> None:
        """Rotates a wrapped ring in place so the kept bytes start at 0
        (the temporary copy is at most half the ring)."""
        view, pos, size = self._view, self._pos, self.limit
        if view is None or pos == 0 or self._filled < size:
            return
        if pos <= size // 2:
            head = bytes(view[:pos])
            view[: size - pos] = view[pos:]
            view[size - pos :] = head
        else:
            tail = bytes(view[pos:])
            view[size - pos :] = view[:pos]
            view[: size - pos] = tail
        self._pos = 0

    def take_text(self) -> str:
        """The kept bytes as UTF-8 text (invalid bytes replaced), decoded
        straight from the buffer; releases the buffer. At the peak this
        holds the buffer and the text: twice the limit."""
        self._unwrap()
        (piece,) = self._pieces()
        text = str(piece, "utf-8", "replace")
        del piece
        self._release()
        return text


class Forwarder:
    """Copies a stream to a host descriptor as it arrives (for the CLI)."""

    truncated = False

    def __init__(self, target: int) -> None:
        self.target = target

    def read_from(self, fd: int) -> int:
        data = os.read(fd, READ_CHUNK)
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.target, view) :]
            except BlockingIOError:
                select.select([], [self.target], [])
            except BrokenPipeError:
                break  # nobody reads our output any more; keep draining
        return len(data)


Sink = CappedBuffer | Forwarder


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


SendRequest = Callable[[bytes, Sequence[int]], Awaitable[None]]


async def run(
    send: SendRequest,
    message: bytes,
    memfd: int | None,
    *,
    input: bytes | None,
    timeout: float | None,
    stdout: Sink,
    stderr: Sink,
    stop_on_overflow: bool,
    stdin_fd: int,
) -> Outcome:
    """Starts the command described by `message` and waits for it.

    The command reads `input` through a pipe or, when input is None,
    straight from `stdin_fd` (/dev/null, or a non-terminal host stdin).
    """
    outcome = Outcome(None, stdout, stderr, None)
    chan, chan_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    to_close: list[int] = []  # host ends, closed at the very end
    try:
        out_r, out_w = os.pipe()
        to_close.append(out_r)
        err_r, err_w = os.pipe()
        to_close.append(err_r)
        if input is None:
            in_r, in_w = stdin_fd, -1
        else:
            in_r, in_w = os.pipe()
            to_close.append(in_w)
        child_ends = [chan_child.fileno(), in_r, out_w, err_w] + ([memfd] if memfd is not None else [])
        try:
            await send(message, child_ends)
        finally:
            # The init holds its own copies now (or never will).
            chan_child.close()
            for fd in (out_w, err_w, memfd):
                if fd is not None:
                    os.close(fd)
            if in_w >= 0:
                os.close(in_r)
        await _drive(chan, out_r, err_r, in_w, input, to_close, outcome, timeout, stop_on_overflow)
        return outcome
    finally:
        # Closing the channel before the exit was reported makes the init
        # kill the command's tree (cancellation, overflow, errors).
        chan.close()
        for fd in to_close:
            try:
                os.close(fd)
            except OSError:
                pass


async def _drive(
    chan: socket.socket,
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
    chan.setblocking(False)
    chan_fd = chan.fileno()
    replies = bytearray()
    pending = memoryview(input) if input else memoryview(b"")
    poller = Poller()
    try:
        for fd in streams:
            os.set_blocking(fd, False)
            poller.want_read(fd)
        poller.want_read(chan_fd)
        if in_w >= 0:
            if pending:
                os.set_blocking(in_w, False)
                poller.want_write(in_w)
            else:
                _close(in_w, to_close)  # empty input: the command reads EOF at once
                in_w = -1

        now = anyio.current_time()
        deadline = now + timeout if timeout is not None else math.inf
        while True:
            if outcome.returncode is not None and not streams:
                return
            now = anyio.current_time()
            if now >= deadline:
                if outcome.returncode is not None or outcome.timed_out:
                    return  # grace after exit, or the kill went unanswered
                outcome.timed_out = True
                _signal(chan, signal.SIGKILL)
                deadline = now + KILL_WAIT
                continue
            ready: set[int] = set()
            with anyio.move_on_after(deadline - now):
                ready = await poller.wait()
            for fd in ready:
                if fd in streams:
                    buf = streams[fd]
                    if _drain(fd, buf):
                        poller.forget(fd)
                        _close(fd, to_close)
                        del streams[fd]
                    if stop_on_overflow and buf.truncated:
                        outcome.overflowed = True
                        _signal(chan, signal.SIGKILL)
                        return
                elif fd == chan_fd:
                    if not _read_replies(chan, replies, outcome):
                        poller.forget(chan_fd)
                        if outcome.returncode is None:
                            outcome.channel_lost = True
                            return
                    if outcome.returncode is not None and deadline > anyio.current_time() + EXIT_GRACE:
                        deadline = anyio.current_time() + EXIT_GRACE
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


def _read_replies(chan: socket.socket, replies: bytearray, outcome: Outcome) -> bool:
    """Consumes replies; False once the init closed the channel."""
    while True:
        try:
            data = chan.recv(4096)
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        if not data:
            return False
        replies += data
        for r in protocol.parse_replies(replies):
            if r.kind == protocol.REPLY_EXIT:
                outcome.returncode = r.code
            elif r.kind == protocol.REPLY_FAIL and outcome.failure is None:
                outcome.failure = r


def _signal(chan: socket.socket, sig: int) -> None:
    try:
        chan.send(protocol.SIGNAL.pack(sig))
    except OSError:
        pass  # the init is gone or the command already reported


def _close(fd: int, to_close: list[int]) -> None:
    to_close.remove(fd)
    os.close(fd)
