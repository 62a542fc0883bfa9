"""The command pump on its own: real pipes and a channel whose other end
plays the init (replies in, signal numbers out)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import anyio
import pytest

from nsbox.init import protocol
from nsbox.init.capture import CappedBuffer, Forwarder
from nsbox.init.client import Channel
from nsbox.init.pump import EXIT_GRACE, Pump, drain


def reply(kind: int, code: int = 0, err: int = 0, stage: int = 0) -> bytes:
    return protocol.REPLY.pack(kind, code, err, stage)


class Command:
    """A command's descriptors as the init would hold them, and a pump on ours."""

    def __init__(self, limit: int = 1 << 20, input: bytes | None = None, keep_stdin: bool = False) -> None:
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self.in_r = -1
        in_w = -1
        if input is not None:
            self.in_r, in_w = os.pipe()
        self.init, chan = socket.socketpair()
        self.out, self.err = CappedBuffer(limit), CappedBuffer(limit)
        self.fed = threading.Event()
        self.pump = Pump({out_r: self.out, err_r: self.err}, input, stdin=in_w, keep_stdin=keep_stdin,
                         on_input_done=self.fed.set)
        self.pump.chan = Channel(chan)
        self.in_w = in_w

    def close_output(self) -> None:
        for fd in (self.out_w, self.err_w):
            os.close(fd)
        self.out_w = self.err_w = -1

    def signals(self) -> list[int]:
        self.init.setblocking(False)
        try:
            data = self.init.recv(64)
        except BlockingIOError:
            return []
        return [s for (s,) in protocol.SIGNAL.iter_unpack(data)]

    def close(self) -> None:
        self.pump.close()
        for fd in (self.out_w, self.err_w, self.in_r):
            if fd >= 0:
                os.close(fd)
        self.init.close()


async def test_output_and_exit() -> None:
    c = Command()
    try:
        os.write(c.out_w, b"out")
        os.write(c.err_w, b"err")
        c.close_output()
        c.init.send(reply(protocol.REPLY_EXIT, 3))
        with anyio.fail_after(5):
            await c.pump.run()
        assert c.pump.chan.returncode == 3 and c.pump.chan.failure is None
        assert (c.out.take(), c.err.take()) == (b"out", b"err")
        assert not c.pump.streams and not (c.pump.lost or c.pump.timed_out or c.pump.overflowed)
    finally:
        c.close()


async def test_output_held_open_after_the_exit_is_waited_for_briefly() -> None:
    c = Command()
    try:
        os.write(c.out_w, b"before")
        c.init.send(reply(protocol.REPLY_EXIT, 0))  # a background process keeps stdout open
        started = time.monotonic()
        with anyio.fail_after(5):
            await c.pump.run()
        assert EXIT_GRACE * 0.9 <= time.monotonic() - started < EXIT_GRACE + 1
        assert c.pump.chan.returncode == 0 and not c.pump.timed_out
        assert c.out.take() == b"before"
    finally:
        c.close()


async def test_timeout_kills_and_waits_for_the_exit() -> None:
    c = Command()
    try:
        async def init() -> None:
            await anyio.wait_readable(c.init)
            assert c.signals() == [signal.SIGKILL]
            c.close_output()
            c.init.send(reply(protocol.REPLY_EXIT, 128 + signal.SIGKILL))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(init)
                await c.pump.run(timeout=0.2)
        assert c.pump.timed_out and c.pump.chan.returncode == 137
    finally:
        c.close()


@pytest.mark.parametrize("failed", [False, True])
async def test_a_channel_closed_without_an_exit_is_lost(failed: bool) -> None:
    c = Command()
    try:
        if failed:
            c.init.send(reply(protocol.REPLY_FAIL, 0, 2, protocol.STAGE_EXEC))
        c.init.close()
        with anyio.fail_after(5):
            await c.pump.run()  # at once, though stdout is still open
        assert c.pump.lost and c.pump.chan.returncode is None
        assert (c.pump.chan.failure is not None) == failed
    finally:
        c.close()


async def test_overflow_stops_reading_and_kills() -> None:
    c = Command(limit=1000)
    try:
        os.write(c.out_w, b"x" * 5000)

        async def init() -> None:
            await anyio.wait_readable(c.init)
            assert c.signals() == [signal.SIGKILL]
            c.init.send(reply(protocol.REPLY_EXIT, 137))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(init)
                await c.pump.run(stop_on_overflow=True)
        assert c.pump.overflowed and not c.pump.streams  # stdout is still open on the other side
        assert c.out.truncated
    finally:
        c.close()


@pytest.mark.parametrize("keep_stdin", [False, True])
async def test_input_is_fed_then_stdin_closed_unless_kept(keep_stdin: bool) -> None:
    data = os.urandom(3 << 20)  # more than a pipe holds
    c = Command(input=data, keep_stdin=keep_stdin)
    got = bytearray()

    def command() -> None:  # reads its stdin up to what it was given (or EOF)
        while len(got) < len(data):
            chunk = os.read(c.in_r, 1 << 16)
            if not chunk:
                break
            got.extend(chunk)
        c.close_output()
        c.init.send(reply(protocol.REPLY_EXIT, 0))

    try:
        thread = threading.Thread(target=command)
        thread.start()
        with anyio.fail_after(10):
            await c.pump.run()
        thread.join()
        assert bytes(got) == data and c.fed.is_set()
        if keep_stdin:
            os.write(c.in_w, b"more")  # still open: the owner's to write and close
            assert os.read(c.in_r, 16) == b"more"
            os.close(c.in_w)
        else:
            assert c.pump.stdin == -1
            assert os.read(c.in_r, 16) == b""  # EOF: our end is closed
    finally:
        c.close()


def test_drain_reads_a_pty_to_the_end() -> None:
    # A pty master reads EIO once every slave descriptor is closed: the end
    # of the stream, as EOF is for a pipe (nsbox shell).
    master, slave = os.openpty()
    r, w = os.pipe()
    try:
        os.set_blocking(master, False)
        os.write(slave, b"last words\n")
        os.close(slave)
        assert drain(master, Forwarder(w)) is True
        assert os.read(r, 100).replace(b"\r\n", b"\n") == b"last words\n"
    finally:
        for fd in (master, r, w):
            os.close(fd)


def test_read_status_keeps_the_exit_and_the_first_failure() -> None:
    a, b = socket.socketpair()
    chan = Channel(a)
    try:
        assert chan.read_status() is False and not chan.answered
        b.send(reply(protocol.REPLY_STARTED) + reply(protocol.REPLY_FAIL, 0, 13, protocol.STAGE_EXEC)[:7])
        assert chan.read_status() is False and chan.answered and chan.failure is None  # half a reply
        b.send(reply(protocol.REPLY_FAIL, 0, 13, protocol.STAGE_EXEC)[7:]
               + reply(protocol.REPLY_FAIL, 0, 2, protocol.STAGE_CWD) + reply(protocol.REPLY_EXIT, 127))
        b.close()
        assert chan.read_status() is True
        assert chan.failure is not None and (chan.failure.err, chan.failure.stage) == (13, protocol.STAGE_EXEC)
        assert chan.returncode == 127
    finally:
        chan.close()


async def test_a_stream_over_its_budget_lets_the_loop_run_other_tasks() -> None:
    """The poller answers at once while output waits, so a pump fed
    without end never gave the loop back: 16 unread `yes` under
    exec_remote had left the host's event loop 34 turns in 3 s. Once a
    stream has had its budget, the pump lets others run before it reads on."""

    class Sink:
        drain_budget = 65536  # as a stream whose consumer is a whole queue behind

        def __init__(self) -> None:
            self.total = 0

        def read_from(self, fd: int) -> int:
            n = len(os.read(fd, 65536))
            self.total += n
            return n

    reader, writer = socket.socketpair()
    for s, opt in ((reader, socket.SO_RCVBUF), (writer, socket.SO_SNDBUF)):
        s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    writer.setblocking(False)
    queued = 0
    try:
        while True:
            queued += writer.send(bytes(1 << 16))
    except BlockingIOError:
        pass
    assert queued > 4 * Sink.drain_budget  # all of it ready before the pump starts
    reader.setblocking(False)
    sink = Sink()
    init, chan = socket.socketpair()
    pump = Pump({reader.detach(): sink})
    pump.chan = Channel(chan)
    seen_at: list[int] = []

    async def other_task() -> None:
        seen_at.append(sink.total)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump.run)
            tg.start_soon(other_task)
            with anyio.fail_after(10):
                while sink.total < queued:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        pump.close()
        init.close()
        writer.close()
    assert seen_at and seen_at[0] < queued, (seen_at, queued)
