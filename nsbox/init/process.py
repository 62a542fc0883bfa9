"""Running one command in a sandbox and waiting for it: exec.

The command's streams, stdin, timeout and exit are the pump's
(nsbox/init/pump.py), its output collected in capture.py's sinks; what the
outcome means to the caller (a result, or the exception the contract
names) is result()'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import execfds, protocol
from ..errors import CommandTimeout, OutputLimitExceeded, SandboxUnavailable
from .capture import Sink
from .client import Command, ExecResult, InitClient, failed_start
from .output_limits import human_size
from .pump import Pump


_devnull = -1


def devnull() -> int:
    """This process's /dev/null, opened once: what commands without input
    read and detached commands write to (one descriptor, not one per sandbox)."""
    global _devnull
    if _devnull < 0:
        _devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    return _devnull


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

    def result(self, command: Command, sandbox_id: str, timeout: float | None, limit: int, stdout: str,
               stderr: str) -> ExecResult:
        """What the outcome means to the caller: a result, or the exception
        the contract names. `stdout`/`stderr` are the collected text."""
        name = command.argv[0]
        if self.channel_lost:
            raise SandboxUnavailable(f"sandbox {sandbox_id} stopped while running {name!r}")
        if self.timed_out:
            raise CommandTimeout(f"command timed out after {timeout:g}s: {name}", stdout, stderr)
        if self.overflowed:
            raise OutputLimitExceeded(
                f"The sandbox output stream limit of {human_size(limit)} was exceeded.", limit, stdout, stderr)
        if self.failure is not None:
            return failed_start(self.failure, name, command.cwd)
        assert self.returncode is not None
        return ExecResult(self.returncode == 0, self.returncode, stdout, stderr,
                          self.stdout.dropped, self.stderr.dropped)


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
    fds = execfds.take()
    # The pump owns our ends (out_r, err_r, the stdin pipe's write end)
    # and, once the init has the request, the channel.
    pump = Pump({fds.out_r: stdout, fds.err_r: stderr}, input, pool=client.pollers)
    try:
        in_r = stdin_fd
        try:
            if input is not None:
                in_r, pump.stdin = os.pipe()
            # No STARTED: we wait for EXIT (or FAIL), and a reply we would
            # only discard costs a wakeup on each side.
            pump.chan = await client.start(cmd, (in_r, fds.out_w, fds.err_w), flags=flags | protocol.F_NO_STARTED,
                                           channel=(fds.chan, fds.chan_child))
        finally:
            # The init holds its own copies now (or never will).
            fds.close_child_ends()
            if pump.stdin >= 0:
                os.close(in_r)
            if pump.chan is None:
                fds.chan.close()
        execfds.restock()  # for the next exec, while the init starts this one
        await pump.run(timeout, stop_on_overflow)
        chan = pump.chan
        return Outcome(chan.returncode, stdout, stderr, chan.failure, pump.timed_out, pump.overflowed,
                       pump.lost and chan.failure is None)
    finally:
        pump.close()
