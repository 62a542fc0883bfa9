"""Sandbox root attacking its own sandbox: mounts, the init, the lifeline.

Sandbox root is the default user and holds every capability inside the
sandbox. It must still not be able to undo what setup put in place: make a
read-only mount writable, uncover what a mount hides, or reach into the init
(whose connection to the owner is the sandbox's lifeline).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import nsbox
from nsbox.create import zygote
from nsbox.spec import Bind

ATTACK_INIT = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    r = libc.syscall(*args)
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
SYS_ptrace, SYS_pidfd_open, SYS_pidfd_getfd = 101, 434, 438
print("ptrace", call("ptrace", SYS_ptrace, 16, 1, 0, 0))           # PTRACE_ATTACH to PID 1
pidfd = libc.syscall(SYS_pidfd_open, 1, 0)
print("getfd", call("getfd", SYS_pidfd_getfd, pidfd, 3, 0) if pidfd >= 0 else "no-pidfd")
for path in ("/proc/1/fd/3", "/proc/1/root", "/proc/1/environ"):
    try:
        os.readlink(path) if "fd" in path or "root" in path else open(path).read()
        print(path, "ok")
    except OSError as e:
        print(path, errno.errorcode[e.errno])
"""


# With nested_userns the seccomp filter lets mount(2) through: then the
# mount lock alone must hold.
NESTED = pytest.mark.parametrize("nested_userns", [False, True], ids=["filtered", "nested-userns"])


@NESTED
async def test_readonly_mounts_stay_readonly(tmp_path: Path, nested_userns: bool) -> None:
    (tmp_path / "f").write_text("original\n")
    os.chmod(tmp_path, 0o755)
    async with nsbox.Sandbox(mounts=[Bind(str(tmp_path), "/data", readonly=True)], nested_userns=nested_userns) as sb:
        for target in ("/data", "/usr"):
            r = await sb.exec(["mount", "-o", "remount,rw,bind", target])
            assert not r.success, f"sandbox root remounted {target} read-write"
            assert (await sb.exec(["touch", f"{target}/nsbox-probe"])).returncode != 0
        r = await sb.exec(["sh", "-c", "echo hacked > /data/f"])
        assert not r.success
    assert (tmp_path / "f").read_text() == "original\n"
    assert not Path("/usr/nsbox-probe").exists()


@NESTED
async def test_mounts_cannot_be_uncovered(nested_userns: bool) -> None:
    # Unmounting a bind or the /proc over the root would reveal what is under it.
    async with nsbox.Sandbox(nested_userns=nested_userns) as sandbox:
        for target in ("/dev/null", "/usr", "/proc", "/dev"):
            r = await sandbox.exec(["umount", "-l", target])
            assert not r.success, f"sandbox root unmounted {target}"
        assert (await sandbox.exec(["python3", "-c", "print(1)"])).stdout == "1\n"


async def test_init_is_out_of_reach(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["python3", "-c", ATTACK_INIT])
    results = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    assert results["ptrace"] == "EPERM"
    assert results["getfd"] == "EPERM"
    assert results["/proc/1/fd/3"] in ("EACCES", "EPERM")
    assert results["/proc/1/root"] in ("EACCES", "EPERM")
    assert results["/proc/1/environ"] in ("EACCES", "EPERM")


# setns as the init's children make it (csrc/init/seccomp.c), on descriptors a
# sandbox process places at the init's numbers itself.
ATTACK_SETNS = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000
FD_USERNS, FD_MNTNS = int(sys.argv[1]), int(sys.argv[2])
def setns(path, at, nstype):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return "open:" + errno.errorcode[e.errno]
    if fd != at:
        os.dup2(fd, at)
    return "ok" if libc.setns(at, nstype) == 0 else errno.errorcode[ctypes.get_errno()]
print("own-user", setns("/proc/self/ns/user", FD_USERNS, CLONE_NEWUSER))
print("own-mnt", setns("/proc/self/ns/mnt", FD_MNTNS, CLONE_NEWNS))
print("mnt-at-user-fd", setns("/proc/self/ns/mnt", FD_USERNS, CLONE_NEWNS))
print("mnt-any-type", setns("/proc/self/ns/mnt", FD_MNTNS, 0))
print("mnt-other-fd", setns("/proc/self/ns/mnt", 9, CLONE_NEWNS))
print("init-user", setns("/proc/1/ns/user", FD_USERNS, CLONE_NEWUSER))
print("init-mnt", setns("/proc/1/ns/mnt", FD_MNTNS, CLONE_NEWNS))
"""


def _status(path: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(path).read_text().splitlines() if ":\t" in line)


async def test_the_init_carries_the_filter_and_allows_only_its_own_setns(sandbox: nsbox.Sandbox, mode: str) -> None:
    """The init installs the seccomp filter on itself, once; commands inherit
    it. The only setns it lets through are the init's two, and through those
    sandbox root reaches no namespace but its own."""
    r = await sandbox.exec(["cat", "/proc/self/status"])
    assert "Seccomp:\t2\n" in r.stdout and "Seccomp_filters:\t1\n" in r.stdout  # inherited, not stacked
    # (Read after an exec: the init installs the filter before it serves a
    # request, which may be after create() has returned.)
    assert _status(f"/proc/{sandbox.pid}/status")["Seccomp"] == "2"
    r = await sandbox.exec(["python3", "-c", ATTACK_SETNS, str(zygote.lib.NSBOX_FD_USERNS),
                            str(zygote.lib.NSBOX_FD_MNTNS)])
    results = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert r.success, r.stderr
    assert results["own-user"] == "EINVAL"  # the kernel: it is already there
    assert results["own-mnt"] == "ok"  # root re-entering its own mount namespace
    for name in ("mnt-at-user-fd", "mnt-any-type", "mnt-other-fd"):
        assert results[name] == "EPERM", (name, results)
    # The init's own namespaces cannot even be opened.
    assert results["init-user"] in ("open:EACCES", "open:EPERM")
    assert results["init-mnt"] in ("open:EACCES", "open:EPERM")
    # A user other than root (single mode has no other): the kernel refuses
    # it even its own mount namespace.
    if mode != "single":
        r = await sandbox.exec(["python3", "-c", ATTACK_SETNS, str(zygote.lib.NSBOX_FD_USERNS),
                                str(zygote.lib.NSBOX_FD_MNTNS)], user="nobody")
        assert dict(line.split(" ", 1) for line in r.stdout.splitlines())["own-mnt"] == "EPERM", r.stderr


async def test_pid_one_ignores_signals_from_inside(sandbox: nsbox.Sandbox) -> None:
    await sandbox.exec(["kill", "-KILL", "1"])
    await sandbox.exec(["kill", "-TERM", "1"])
    assert (await sandbox.exec(["echo", "alive"])).stdout == "alive\n"


async def test_sandbox_cannot_see_host_processes(sandbox: nsbox.Sandbox) -> None:
    marker = "31415.926"
    host = subprocess.Popen(["sleep", marker])
    try:
        r = await sandbox.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
        assert r.success and "sleep" not in r.stdout and marker not in r.stdout
        assert "nsbox-init" in r.stdout
    finally:
        host.kill()
        host.wait()


# Holds user namespaces (by descriptor, their creators gone) until the kernel
# refuses one; prints how many it holds and why the next failed.
HOLD_USER_NAMESPACES = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
held, why = [], "none"
while len(held) < 5000:
    go_r, go_w = os.pipe()
    said_r, said_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = libc.unshare(0x10000000) == 0  # CLONE_NEWUSER
        os.write(said_w, b"ok" if ok else errno.errorcode[ctypes.get_errno()].encode())
        os.read(go_r, 1)
        os._exit(0)
    said = os.read(said_r, 64).decode()
    if said == "ok":
        held.append(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY))
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    for fd in (go_r, go_w, said_r, said_w):
        os.close(fd)
    if said != "ok":
        why = said
        break
print(len(held), why)
"""


@pytest.mark.timeout(120)
async def test_a_nested_userns_sandbox_holds_a_bounded_number_of_namespaces() -> None:
    """A sandbox with nested_userns had created 96,000 user namespaces,
    counted against its host user's quota: that user's next `unshare -U`,
    and so its next sandbox, failed. Each kind is bounded per sandbox now,
    in its own user namespace, where its commands cannot raise the bound."""
    from nsbox.plan.plan import NAMESPACES_MAX

    async with nsbox.Sandbox(nested_userns=True) as sb:
        r = await sb.exec(["python3", "-c", HOLD_USER_NAMESPACES], timeout=100)
        held, why = r.stdout.split()
        assert why == "ENOSPC" and NAMESPACES_MAX - 8 <= int(held) < NAMESPACES_MAX, r
        # Raising it from inside changes only the commands' own namespace's.
        r = await sb.exec(["sh", "-c", "echo 100000 > /proc/sys/user/max_user_namespaces"])
        assert r.returncode != 0
    async with nsbox.Sandbox() as plain:  # the host user can still make sandboxes
        assert (await plain.exec(["true"])).returncode == 0
