"""Masked and read-only kernel paths, as OCI runtimes set them up: the
contributor of a sandbox's plan (see nsbox/plan/plan.py) for /proc.

- masked: the files get /dev/null bound over them (they read empty), the
  directories an empty read-only tmpfs;
- read-only: bound over themselves, then remounted read-only.

The masks go on in the INSIDE phase, once the sandbox's own /dev/null
exists, and before the init creates the nested namespaces that lock every
mount (csrc/create/child.c): a process of the sandbox, even root, even with
nested_userns, can neither unmount them nor remount them writable.

A consequence: the kernel mounts a new procfs only where a fully visible
one exists, so a sandbox with nested_userns cannot mount a fresh /proc of
its own, and an nsbox (or any container runtime) inside it falls back to
binding the /proc it sees (below).

/sys: nsbox mounts no sysfs, so /sys is an empty directory, or missing, and
/sys/firmware and /sys/devices/virtual/powercap do not exist in a sandbox;
a privileged one gets a /sys with those two masked (plan.contribute_sysfs).

Where the host's own /proc has over-mounts (inside a container or a pod,
whose runtime masked it), the kernel refuses a new procfs in the sandbox.
nsbox then binds the host's /proc recursively (what the runtime left
visible, with its masks), puts the same masks over it, and says so once:
that /proc shows the host's (the container's) processes, not only the
sandbox's.
"""

from __future__ import annotations

import functools
import os
import select

from . import steps as s
from ..errors import note_once
from ..host.probe import MOUNTINFO, mountinfo as read_mountinfo
from .plan import Phase, Plan

MASKED = ("acpi", "asound", "kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug", "scsi")
READ_ONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")
PROC_FLAGS = ("MS_NOSUID", "MS_NODEV", "MS_NOEXEC")

FALLBACK_NOTE = ("the host's /proc has masked paths (inside a container?), so the kernel refuses a fresh /proc: "
                 "sandboxes get a bind of the host's /proc, with the same masks, which lists the host's processes")

# Tests switch the masks off to show that their tests fail without them.
enabled = True


def host_proc_covered(mountinfo: str = MOUNTINFO) -> list[str]:
    """Mount points inside this process's /proc: where the kernel would
    refuse a fresh procfs in a user namespace (an empty directory such as
    binfmt_misc does not count)."""
    return [m.point for m in read_mountinfo(mountinfo)
            if m.point.startswith("/proc/") and not m.point.startswith("/proc/sys/fs/binfmt_misc")]


class _CoveredWatch:
    """host_proc_covered() of this process, read again only when its mount
    table changed: a descriptor of /proc/self/mountinfo polls POLLPRI after
    any mount or unmount in the namespace (each poll that reports one
    consumes it). Reading the table costs ~0.1 ms, a poll a few us."""

    def __init__(self) -> None:
        self.fd = -1
        self.pid = 0
        self.covered: list[str] = []

    def get(self) -> list[str]:
        if self.pid != os.getpid():  # first use, or a forked child
            if self.fd >= 0:
                os.close(self.fd)
            self.fd, self.pid = -1, os.getpid()
            try:
                self.fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return host_proc_covered()
            self.covered = host_proc_covered()  # read after the open: no change is missed
            return self.covered
        if self.fd < 0:
            return host_proc_covered()
        p = select.poll()
        p.register(self.fd, select.POLLPRI)
        if p.poll(0):
            self.covered = host_proc_covered()
        return self.covered


_covered = _CoveredWatch()
covered = _covered.get


@functools.cache
def _existing() -> tuple[tuple[str, bool], ...]:
    """The masked and read-only names this kernel's /proc has, each with
    whether it is a directory. A fresh procfs of the same kernel has the
    same top-level entries (those that vary with the namespaces, such as
    /proc/net, are none of ours)."""
    return tuple((name, os.path.isdir(f"/proc/{name}")) for name in (*MASKED, *READ_ONLY)
                 if os.path.lexists(f"/proc/{name}"))


def mount_proc(plan: Plan, proc: str) -> None:
    """Mounts the sandbox's /proc at `proc` (MOUNT phase): a fresh procfs,
    or, where the host's /proc is masked, a recursive bind of it."""
    if not covered():
        plan.add(Phase.MOUNT, s.mount("proc", proc, "proc", PROC_FLAGS, None, "mount a fresh /proc"))
        return
    note_once(FALLBACK_NOTE)
    slot = plan.slot("/proc")
    plan.add(Phase.HOST, s.tree_clone("/proc", slot, "take a copy of the host's /proc", recursive=True, nosuid=True))
    plan.add(Phase.MOUNT, s.tree_attach(slot, proc, "attach the copy of the host's /proc"))


def contribute(plan: Plan) -> None:
    """Masks and read-only binds over /proc (INSIDE phase, after /dev)."""
    if not enabled:
        return
    masked = set(MASKED)
    for name, is_dir in _existing():
        path = f"/proc/{name}"
        if name in masked and is_dir:
            plan.add(Phase.INSIDE, s.mount("tmpfs", path, "tmpfs", ("MS_RDONLY", *PROC_FLAGS), "mode=555,size=4k",
                                           f"mask {path} with an empty read-only tmpfs"))
        elif name in masked:
            plan.add(Phase.INSIDE, s.mount("/dev/null", path, None, ("MS_BIND",), None, f"mask {path} with /dev/null"))
        else:
            plan.add(Phase.INSIDE,
                     s.mount(path, path, None, ("MS_BIND", "MS_REC"), None, f"bind {path} over itself"),
                     s.remount(path, ("MS_BIND", "MS_RDONLY", *PROC_FLAGS), f"make {path} read-only"))
