"""A running command whose output streams to the host as it is written.

Sandbox.exec waits for a command and returns its output; Sandbox.start_process
returns a Process at once (once the init says the command runs), and its
output arrives as events, with no polling: the command writes into pipes
whose host ends a background *pump* watches (nsbox/init/pump.py, exec's
too), together with the command's channel (nsbox/init/client.py), on which
the init reports the exit.

The pump never stops reading, so a command never blocks on a consumer that
does not read. What waits for the consumer is held in one OutputQueue per
stream (nsbox/init/capture.py) with exec's limit and front-truncation: the host
holds at most the limit plus a constant per stream, and the bytes dropped
are counted (Output.dropped, Process.stdout_truncated/stderr_truncated).

Events: Output(stream, data, dropped) in the order the command wrote them
(stdout and stderr interleaved by read), then one Exit(returncode), 128+N
for a signal N, also after kill(). As with exec, output is read for 0.1 s
after the exit, no longer: a background process that keeps the command's
stdout open does not keep the Process running. A command the init cannot
start behaves as exec: a missing command gives a message on stderr and
Exit(127); a file that is not executable raises PermissionError from
start_process.
"""

from __future__ import annotations

import asyncio
import codecs
import itertools
import math
import os
import signal as signal_mod
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

import anyio

from . import fdwait
from .capture import READ_CHUNK, OutputQueue
from .client import START_TIMEOUT, Channel, Command, ExecResult, InitClient, failed_start
from ..errors import NsboxError, SandboxUnavailable
from .pump import DRAIN_BUDGET, KILL_WAIT, Pump

Stream = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class Output:
    """Bytes the command wrote on one stream."""

    stream: Stream
    data: bytes
    dropped: int = 0
    """Bytes of this stream dropped just before `data`, because the
    consumer fell more than the output limit behind (0: none)."""


@dataclass(frozen=True)
class Exit:
    """The command exited (the last event)."""

    returncode: int

    @property
    def success(self) -> bool:
        return self.returncode == 0


Event = Output | Exit

_ids = itertools.count(1)
# Pumps running on asyncio, referenced so that they are not collected.
_pumps: set[asyncio.Task[None]] = set()


def _background(fn: Callable[[], Awaitable[None]]) -> None:
    """Runs `fn` as a task of its own, outliving the caller's task (the
    process outlives the call that started it). `fn` must not raise."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio
        import trio

        trio.lowlevel.spawn_system_task(fn)
        return
    task: asyncio.Task[None] = loop.create_task(fn())  # type: ignore[arg-type]
    _pumps.add(task)
    task.add_done_callback(_pumps.discard)


class _Interleaved:
    """The pump's sink for one stream: reads go into the stream's queue,
    tagged so that the consumer gets both streams in the order they came."""

    def __init__(self, queue: OutputQueue, order: list[Any]) -> None:
        self.queue = queue
        self.order = order  # shared by both streams: [sequence number, the stream read last]

    @property
    def total(self) -> int:
        return self.queue.total

    @property
    def drain_budget(self) -> int:
        """What the pump reads at a wake: once the consumer has fallen a
        whole queue behind, one chunk, so that commands whose output no one
        reads (a chatty server under exec_remote) are drained at the event
        loop's pace, not with its time: 16 `yes` had left it 34 turns in 3 s."""
        return READ_CHUNK if self.queue.size >= self.queue.limit else DRAIN_BUDGET

    def read_from(self, fd: int) -> int:
        data = os.read(fd, READ_CHUNK)
        if data:
            order = self.order
            if order[1] is not self:
                order[0] += 1
                order[1] = self
            self.queue.append(data, order[0])
        return len(data)


class Process:
    """A command running in a sandbox (from Sandbox.start_process).

    Iterate it (once) for its events; write_stdin/close_stdin feed it (with
    stdin_open=True); kill() ends its process tree; wait() returns what is
    left as an ExecResult. As an async context manager it is killed on
    exit if it still runs. The process outlives the task that started it;
    it ends when the command exits, when killed, or with the sandbox.
    """

    def __init__(self, chan: Channel, out_r: int, err_r: int, in_w: int, input: bytes | None, keep_stdin: bool,
                 limit: int, command: Command, sandbox_id: str) -> None:
        self.id = next(_ids)
        """A number unique in this host process (the init does not report
        the command's pid)."""
        self.command = command
        self.returncode: int | None = None
        self._chan = chan
        self._keep_stdin = keep_stdin
        # The pump owns stdin unless it stays open for write_stdin: then it is ours.
        self._in_w = in_w if keep_stdin else -1
        self._sandbox_id = sandbox_id
        self._queues: dict[Stream, OutputQueue] = {"stdout": OutputQueue(limit), "stderr": OutputQueue(limit)}
        self._reported_drops: dict[Stream, int] = {"stdout": 0, "stderr": 0}
        self._started = anyio.Event()  # STARTED or FAIL arrived, or the pump ended
        self._input_done = anyio.Event()  # the initial input is written (or given up)
        order: list[Any] = [0, None]
        streams = {fd: _Interleaved(self._queues[name], order)
                   for fd, name in ((out_r, "stdout"), (err_r, "stderr")) if fd >= 0}
        self._pump = Pump(streams, input, stdin=in_w, keep_stdin=keep_stdin, on_input_done=self._input_done.set)
        self._pump.chan = chan
        self._done = anyio.Event()  # the pump ended: every descriptor is closed
        self._wake = anyio.Event()  # replaced each time the pump has news
        self._scope = anyio.CancelScope()
        self._finished = False
        self._error: BaseException | None = None
        self._killed = False
        self._exit_sent = False
        self._stdin_lock = anyio.Lock()
        self._writing = False

    # ---- state ------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the pump still runs (the command, or its output, is not done)."""
        return not self._finished

    @property
    def backlog(self) -> int:
        """Bytes of output waiting for the consumer (at most the limit per stream)."""
        return self._queues["stdout"].size + self._queues["stderr"].size

    @property
    def stdout_truncated(self) -> int:
        """Bytes of stdout dropped so far because the consumer fell behind."""
        return self._queues["stdout"].dropped

    @property
    def stderr_truncated(self) -> int:
        return self._queues["stderr"].dropped

    def _notify(self) -> None:
        self._wake.set()
        self._wake = anyio.Event()

    # ---- the pump ---------------------------------------------------------

    async def _run(self) -> None:
        try:
            with self._scope:
                await self._pump.run(on_news=self._news)
        except Exception as e:  # a bug or an unexpected OS error: reported to the consumer
            self._error = e
        finally:
            # Closing the channel before the exit was reported makes the init
            # kill the command's tree (a kill that went unanswered, errors).
            self._pump.close()
            self._finished = True
            if not self._writing:
                self._close_stdin_fd()
            self._started.set()
            self._input_done.set()
            self._done.set()
            self._notify()

    def _news(self) -> None:
        """The pump read something: output, or a reply."""
        if self._chan.answered:
            if self._chan.returncode is not None:
                self.returncode = self._chan.returncode
            self._started.set()
        self._notify()

    def _close_stdin_fd(self) -> None:
        fd, self._in_w = self._in_w, -1
        if fd >= 0:
            os.close(fd)

    # ---- events -------------------------------------------------------------

    def _next_output(self) -> Output | None:
        """The oldest waiting output, merged with what follows it on the same
        stream up to the other stream's oldest."""
        out, err = self._queues["stdout"].head(), self._queues["stderr"].head()
        if out is None and err is None:
            return None
        stream: Stream = "stdout" if err is None or (out is not None and out <= err) else "stderr"
        other = err if stream == "stdout" else out
        queue = self._queues[stream]
        data = queue.take(math.inf if other is None else other)
        dropped = queue.dropped - self._reported_drops[stream]
        self._reported_drops[stream] = queue.dropped
        return Output(stream, data, dropped)

    def take_output(self) -> list[Output]:
        """The output waiting now, without waiting for more."""
        events = []
        while (event := self._next_output()) is not None:
            events.append(event)
        return events

    def __aiter__(self) -> "Process":
        return self  # events are consumed: iterating again continues where the last loop stopped

    async def __anext__(self) -> Event:
        """The next event: output as it comes, then Exit. Raises
        SandboxUnavailable if the sandbox stopped while the command ran."""
        while True:
            wake = self._wake
            event = self._next_output()
            if event is not None:
                return event
            if self._finished:
                self._raise_if_lost()
                if self.returncode is not None and not self._exit_sent:
                    self._exit_sent = True
                    return Exit(self.returncode)
                raise StopAsyncIteration
            await wake.wait()

    def _raise_if_lost(self) -> None:
        if self._error is not None:
            raise NsboxError(f"streaming the output of {self.command.argv[0]!r} failed: {self._error}") \
                from self._error
        if self._pump.lost and not self._killed:
            raise SandboxUnavailable(f"sandbox {self._sandbox_id} stopped while running {self.command.argv[0]!r}")

    async def wait(self) -> ExecResult:
        """Waits for the exit; returns the status and the output not yet
        taken as events (its last N bytes per stream, as exec keeps them),
        with the bytes dropped counted in stdout_truncated/stderr_truncated.
        A killed command has status 128+9."""
        await self._done.wait()
        self._raise_if_lost()
        out, err = self._queues["stdout"], self._queues["stderr"]
        stdout, stderr = _text(out.take()), _text(err.take())
        code = self.returncode if self.returncode is not None else 128 + signal_mod.SIGKILL
        return ExecResult(code == 0, code, stdout, stderr, out.dropped, err.dropped)

    # ---- stdin --------------------------------------------------------------

    async def write_stdin(self, data: str | bytes) -> None:
        """Writes to the command's stdin (str as UTF-8); returns once the
        pipe took it all. Needs stdin_open=True. Raises BrokenPipeError if
        stdin is closed or the command has exited."""
        if not self._keep_stdin:
            raise ValueError("stdin is not open: start the process with stdin_open=True")
        view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
        await self._input_done.wait()
        async with self._stdin_lock:
            if self._in_w < 0 or self._finished:
                raise BrokenPipeError(32, "the command's stdin is closed")
            self._writing = True
            try:
                os.set_blocking(self._in_w, False)
                await fdwait.write_all(self._in_w, view)
            finally:
                self._writing = False
                if self._finished:
                    self._close_stdin_fd()

    async def close_stdin(self) -> None:
        """Closes the command's stdin (it reads EOF). Idempotent."""
        await self._input_done.wait()
        async with self._stdin_lock:
            self._close_stdin_fd()

    # ---- ending -------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Sends `sig` to the command's process tree (no-op once it is done)."""
        if not self._finished:
            self._chan.signal(sig)

    async def kill(self) -> None:
        """Kills the command's process tree and waits until it is gone (a
        no-op if it is already done). Its Exit (137) still arrives, after
        the output it wrote before."""
        if self._finished:
            return
        self._killed = True
        self._chan.signal(signal_mod.SIGKILL)
        with anyio.move_on_after(KILL_WAIT):
            await self._done.wait()
        if not self._finished:
            self._scope.cancel()  # the pump closes the channel: the init kills the tree
            await self._done.wait()

    async def __aenter__(self) -> "Process":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.kill()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited {self.returncode}"
        return f"<nsbox.Process {self.id} {self.command.argv[0]!r} {state}>"


def _text(data: bytes) -> str:
    return str(data, "utf-8", "replace")


def decoder() -> Any:
    """An incremental UTF-8 decoder for Output data (invalid bytes replaced,
    characters split across events kept whole)."""
    return codecs.getincrementaldecoder("utf-8")("replace")


async def start(client: InitClient, command: Command, *, input: bytes | None, stdin_open: bool, limit: int,
                devnull: int, sandbox_id: str) -> Process:
    """Starts `command` and returns once the init says whether it runs."""
    to_close: list[int] = []
    chan: Channel | None = None
    try:
        out_r, out_w = os.pipe()
        to_close += [out_r, out_w]
        err_r, err_w = os.pipe()
        to_close += [err_r, err_w]
        if input is None and not stdin_open:
            in_r, in_w = devnull, -1
        else:
            in_r, in_w = os.pipe()
            to_close += [in_r, in_w]
            os.set_blocking(in_w, False)
        chan = await client.start(command, (in_r, out_w, err_w))
    except BaseException:
        if chan is not None:
            chan.close()
        for fd in to_close:
            os.close(fd)
        raise
    # The init holds its own copies of the command's ends now.
    for fd in (out_w, err_w, *([in_r] if in_w >= 0 else [])):
        os.close(fd)
    proc = Process(chan, out_r, err_r, in_w, input, stdin_open, limit, command, sandbox_id)
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
    _background(proc._run)
    try:
        with anyio.fail_after(START_TIMEOUT):
            await proc._started.wait()
    except BaseException as e:
        with anyio.CancelScope(shield=True):
            await proc.kill()
        if isinstance(e, TimeoutError):
            raise NsboxError(f"the sandbox did not start {command.argv[0]!r} within {START_TIMEOUT:g}s") from None
        raise
    if chan.failure is not None:
        with anyio.CancelScope(shield=True):
            await proc._done.wait()  # the helper exits at once
        result = failed_start(chan.failure, command.argv[0], command.cwd)  # may raise, as exec does
        proc._queues["stderr"].append(result.stderr.encode(), 1)
        proc.returncode = result.returncode
    elif proc._finished:
        proc._raise_if_lost()
    return proc


def finished(result: ExecResult, command: Command, sandbox_id: str) -> Process:
    """A Process that already ended with `result` (a command that could not
    run, reported as exec reports it)."""
    chan, other = socket.socketpair()  # a closed channel: nothing to signal
    other.close()
    message = result.stderr.encode()
    proc = Process(Channel(chan), -1, -1, -1, None, False, max(1, len(message)), command, sandbox_id)
    chan.close()
    proc._queues["stderr"].append(message, 1)
    proc.returncode = result.returncode
    proc._finished = True
    for ev in (proc._started, proc._input_done, proc._done):
        ev.set()
    return proc
