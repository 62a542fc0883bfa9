"""Resource limits of the host process.

An idle sandbox holds no descriptor in the process that owns it; a sandbox
in use holds its control connection, and each running exec, creation or
close a few more, for a while. The soft RLIMIT_NOFILE that most
distributions give a user is 1024, while the hard limit is far higher
(often 524288 or more). As Go, Java and systemd's own services do, nsbox
raises the soft limit to the hard one, once per process, when it creates
its first sandbox. What nsbox keeps open for reuse (control connections)
or for speed (pidfds to wait on) stays within descriptor_share() each, so
that a burst over thousands of sandboxes degrades (a reconnect, a polled
wait) instead of failing with EMFILE. Nothing in nsbox's host side uses select() (whose descriptors must
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


def descriptor_share() -> int:
    """How many descriptors one kind of optional use (idle control
    connections; pidfds to wait on) may hold at once: a quarter of the soft
    RLIMIT_NOFILE, leaving the rest to what cannot do without one (commands'
    pipes and channels) and to the caller's own."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft // 4) if soft != resource.RLIM_INFINITY else 1 << 16
