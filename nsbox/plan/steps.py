"""The setup steps of a sandbox, as plain data.

A sandbox's first process runs an ordered list of steps between clone and
the exec of its init (csrc/create/child.c carries them out; create.h documents
each kind). Here they are plain Python values, so that a plan can be built
and checked without the compiled extension: kernel flags are named, not
numbered, and get their values from the C headers when nsbox/create/zygote.py
packs the steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable

PROC_FD = "/proc/self/fd"


class Kind(IntEnum):
    """enum nsbox_step_kind of csrc/common/create.h (checked at import by create/zygote.py)."""

    MOUNT = 1
    TREE_CLONE = 2
    TREE_ATTACH = 3
    MKDIR = 4
    MKFILE = 5
    SYMLINK = 6
    PIVOT = 7
    HOSTNAME = 8
    LOOPBACK_UP = 9
    REMOUNT = 10
    BECOME_ROOT = 11
    PATH_FD = 12
    SYSCTL = 13


# Where PATH_FD steps park descriptors (NSBOX_PATH_FD_BASE, checked too).
PATH_FD_BASE = 200


@dataclass(frozen=True)
class Step:
    """One setup step; `what` says in words what it does, for error messages.

    `flags` names mount(2) flags (MS_*) or AT_RECURSIVE; `attr_set` and
    `attr_clr` name mount_setattr(2) attributes (MOUNT_ATTR_*).
    """

    kind: Kind
    what: str
    a: str | None = None
    b: str | None = None
    c: str | None = None
    d: str | None = None
    flags: frozenset[str] = frozenset()
    mode: int = 0
    slot: int = -1
    attr_set: frozenset[str] = frozenset()
    attr_clr: frozenset[str] = frozenset()

    @property
    def fstype(self) -> str | None:
        return self.c if self.kind == Kind.MOUNT else None


# A step that names its target with IN_ROOT resolves it inside the sandbox's
# root, an image's symlinks on the way followed there (NSBOX_IN_ROOT).
IN_ROOT = frozenset({"NSBOX_IN_ROOT"})


def mount(source: str | None, target: str, fstype: str | None, flags: Iterable[str], data: str | None,
          what: str, *, in_root: bool = False) -> Step:
    return Step(Kind.MOUNT, what, a=source, b=target, c=fstype, d=data,
                flags=frozenset(flags) | (IN_ROOT if in_root else frozenset()))


def tree_clone(source: str, slot: int, what: str, *, recursive: bool = False, readonly: bool = False,
               nosuid: bool = False, noexec: bool = False, no_symlinks: bool = False) -> Step:
    """slot = a detached copy of the mount tree at `source`; with
    `no_symlinks`, a symlink anywhere in `source` fails the step."""
    attrs = {"MOUNT_ATTR_RDONLY"} if readonly else set()
    if nosuid:
        attrs.add("MOUNT_ATTR_NOSUID")
    if noexec:
        attrs.add("MOUNT_ATTR_NOEXEC")
    flags = {"AT_RECURSIVE"} if recursive else set()
    if no_symlinks:
        flags.add("NSBOX_TREE_NO_SYMLINKS")
    return Step(Kind.TREE_CLONE, what, a=source, slot=slot, flags=frozenset(flags), attr_set=frozenset(attrs))


def tree_attach(slot: int, target: str, what: str, *, in_root: bool = False) -> Step:
    return Step(Kind.TREE_ATTACH, what, b=target, slot=slot, flags=IN_ROOT if in_root else frozenset())


def mkdir(path: str, mode: int = 0o755, *, in_root: bool = False) -> Step:
    if in_root:
        return Step(Kind.MKDIR, f"create the directory {path} (where its symlinks lead inside the sandbox's root, "
                                "not into /proc or /sys)", b=path, mode=mode, flags=IN_ROOT)
    return Step(Kind.MKDIR, f"create the directory {path} (it must not be a symlink or a file)", b=path, mode=mode)


def mkfile(path: str, *, in_root: bool = False) -> Step:
    return Step(Kind.MKFILE, f"create mount point {path}", b=path, mode=0o644, flags=IN_ROOT if in_root else frozenset())


def symlink(target: str, path: str) -> Step:
    return Step(Kind.SYMLINK, f"create symlink {path} -> {target}", a=target, b=path)


def remount(target: str, flags: Iterable[str], what: str) -> Step:
    """mount(NULL, target, NULL, MS_REMOUNT | flags, NULL): e.g. a bind made read-only."""
    return Step(Kind.REMOUNT, what, b=target, flags=frozenset(flags))


@functools.cache  # the same object in every plan: see zygote._step_row
def pivot(new_root: str) -> Step:
    return Step(Kind.PIVOT, "pivot_root into the sandbox's root", b=new_root)


def hostname(name: str) -> Step:
    return Step(Kind.HOSTNAME, f"set the hostname to {name}", a=name)


def path_fd(path: str, slot: int) -> Step:
    return Step(Kind.PATH_FD, f"open {path}", a=path, slot=slot)


@functools.cache
def become_root() -> Step:
    return Step(Kind.BECOME_ROOT, "become root of the sandbox's user namespace")


def sysctl(path: str, value: str, what: str) -> Step:
    """Writes `value` to the /proc/sys file `path` (a failure fails the sandbox)."""
    return Step(Kind.SYSCTL, what, a=path, b=value)


# Ports below it need CAP_NET_BIND_SERVICE over the network namespace's owner,
# which sandbox processes (in a nested user namespace) never have.
UNPRIVILEGED_PORT_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
PING_GROUP_RANGE = "/proc/sys/net/ipv4/ping_group_range"


@functools.cache
def loopback_up(groups: int) -> Step:
    """Brings up lo, lets every user of the sandbox bind any port of its
    own network namespace (net.ipv4.ip_unprivileged_port_start=0) and
    send ICMP echo (net.ipv4.ping_group_range, for ping without a raw
    socket, which sandbox root cannot open: the namespace is nsbox's), as
    Docker sets them, for the `groups` gids the sandbox maps (the kernel
    takes no unmapped one): after pivot_root, in the sandbox's /proc."""
    return Step(Kind.LOOPBACK_UP, "bring up the loopback interface, open ports below 1024 and ping to every user",
                a=UNPRIVILEGED_PORT_START, b=PING_GROUP_RANGE, c=f"0 {groups - 1}")
