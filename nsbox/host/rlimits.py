"""Resource limits of the host process.

Each live sandbox holds a few descriptors in the process that owns it (the
control socket, the init's pidfd, /dev/null), and each running exec a few
more. The soft RLIMIT_NOFILE that most distributions give a user is 1024,
while the hard limit is far higher (often 524288 or more): a process would
hit EMFILE after about 300 sandboxes although it may use many more
descriptors. As Go, Java and systemd's own services do, nsbox raises the
soft limit to the hard one, once per process, when it creates its first
sandbox. Nothing in nsbox's host side uses select() (whose descriptors must
stay below 1024); asyncio and trio use epoll.

Child processes the host starts afterwards inherit the raised soft limit.
Sandboxed commands do anyway: nsbox-init raises its own soft limit the
same way, and commands inherit it.
"""

from __future__ import annotations

import resource
import threading

_lock = threading.Lock()
_done = False


def _nr_open() -> int:
    """The kernel's ceiling for RLIMIT_NOFILE (fs.nr_open)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_nofile_limit() -> tuple[int, int]:
    """Raises the soft RLIMIT_NOFILE to the hard limit, the first time it is
    called in this process; returns the (soft, hard) limits in force.

    Never fails: if the limit cannot be raised, it stays as it was.
    """
    global _done
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if _done:
            return soft, hard
        _done = True
        target = min(hard, _nr_open()) if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (OSError, ValueError):
                pass
        return soft, hard

