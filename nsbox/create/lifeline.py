"""The lifeline of this process's sandboxes: one pipe for all of them.

Every init gets the read end (its NSBOX_FD_LIFELINE); only this process
holds the write end. However the process ends, the kernel closes that end,
each init sees POLLHUP and takes its sandbox down (csrc/init/main.c), unless
the sandbox was detached. Sharing one pipe is what lets an idle sandbox cost
this process no descriptor: its control connection can be closed and
reopened without ending it.
"""

from __future__ import annotations

import os
import threading

_pipe: tuple[int, int] | None = None
_lock = threading.Lock()


def read_end() -> int:
    """The descriptor an init gets as its lifeline (CLOEXEC here: no program
    this process starts holds the write end, and so keeps sandboxes alive)."""
    global _pipe
    with _lock:
        if _pipe is None:
            _pipe = os.pipe2(os.O_CLOEXEC)
        return _pipe[0]


def _forget_in_child() -> None:
    # A child forked without exec must not keep its parent's sandboxes alive:
    # it closes its copy of the pipe and makes its own if it creates any.
    # (No lock: another thread may have held it at the fork.)
    global _pipe
    if _pipe is not None:
        for fd in _pipe:
            try:
                os.close(fd)
            except OSError:
                pass
        _pipe = None


os.register_at_fork(after_in_child=_forget_in_child)
