"""The descriptors an exec needs, made while the previous exec runs.

Each exec needs a channel (a socketpair, see nsbox/init/client.py) and two pipes
for the command's stdout and stderr, whose read ends we keep non-blocking.
Making them costs about as much as everything else the host does before
its request leaves, so an exec takes a set made earlier and, once its own
request is on its way (while the init starts the command), makes the set
the next exec will take.

One spare set per process, not per sandbox: an eval keeps many sandboxes,
and each would hold six idle descriptors. A forked child closes the set it
inherited, whose pipes its parent's next exec will use.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass
class ExecFds:
    """One exec's descriptors: ours, and the ends the init hands on."""

    out_r: int
    out_w: int
    err_r: int
    err_w: int
    chan: socket.socket  # ours, non-blocking
    chan_child: socket.socket  # the init's end of the channel

    def close_child_ends(self) -> None:
        """Once the init holds its copies (or never will)."""
        for fd in (self.out_w, self.err_w):
            os.close(fd)
        self.chan_child.close()

    def close(self) -> None:
        for fd in (self.out_r, self.out_w, self.err_r, self.err_w):
            os.close(fd)
        self.chan.close()
        self.chan_child.close()


_spare: ExecFds | None = None


def make() -> ExecFds:
    """A fresh set; on failure (out of descriptors) nothing is left open."""
    made: list[int] = []
    try:
        out_r, out_w = os.pipe()
        made += (out_r, out_w)
        err_r, err_w = os.pipe()
        made += (err_r, err_w)
        chan, chan_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except BaseException:
        for fd in made:
            os.close(fd)
        raise
    os.set_blocking(out_r, False)
    os.set_blocking(err_r, False)
    chan.setblocking(False)
    return ExecFds(out_r, out_w, err_r, err_w, chan, chan_child)


def take() -> ExecFds:
    """The spare set if there is one, else a fresh one."""
    global _spare
    fds, _spare = _spare, None
    return fds if fds is not None else make()


def restock() -> None:
    """Makes the set the next exec takes; a failure is left to that exec,
    which then tries again and reports it."""
    global _spare
    if _spare is None:
        try:
            _spare = make()
        except OSError:
            pass


def _after_fork() -> None:
    global _spare
    if _spare is not None:
        _spare.close()
        _spare = None


os.register_at_fork(after_in_child=_after_fork)
