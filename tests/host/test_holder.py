"""The holder (zygote.Holder, hold() in csrc/create/main.c): where sandbox
root is the owner's own uid (subuid and single modes), sandboxes are
created in user namespaces nested in one per process, whose maps the holder
writes directly; newuidmap runs once per process instead of once per
sandbox. Real root writes maps directly anyway and uses no holder.

Isolation must not weaken: root in one sandbox has no capability over
another sandbox or over the holder. The attack below is made by a
process that entered sandbox A's command user namespace from the host
(what root in A is, without nsbox's seccomp filter in the way), holding
descriptors of the other namespaces, which no real attacker gets: what
refuses it is the kernel's capability model."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import anyio
import psutil
import pytest

import nsbox
from nsbox.create import zygote

from tests.conftest import process_named

pytestmark = pytest.mark.timeout(60)
NS_GET_PARENT = 0xB702


def _parent_inode(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parent = fcntl.ioctl(fd, NS_GET_PARENT)
        try:
            return os.fstat(parent).st_ino
        finally:
            os.close(parent)
    finally:
        os.close(fd)


def _holders() -> list[zygote.Holder]:
    return [h for h in zygote._holders.values() if h.owner == os.getpid() and h.alive()]


async def test_sandboxes_nest_in_the_holder_where_root_is_our_uid(mode: str) -> None:
    ours = os.stat("/proc/self/ns/user").st_ino
    before = set(_holders())  # another test's (single mapping as root, say)
    async with nsbox.Sandbox() as a, nsbox.Sandbox() as b:
        parents = {_parent_inode(f"/proc/{sb.pid}/ns/user") for sb in (a, b)}
        if mode == "root":
            assert parents == {ours}  # created directly by the zygote
            assert set(_holders()) == before  # no holder for them
            return
        [holder] = _holders()
        assert parents == {os.stat(f"/proc/{holder.pid}/ns/user").st_ino}
        assert _parent_inode(f"/proc/{holder.pid}/ns/user") == ours
        # The holder is a child of this process, outside every sandbox.
        assert holder.pid in {p.pid for p in psutil.Process().children()}
        r = await a.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
        assert "nsbox-create" not in r.stdout


# Run as "root in sandbox A": enter A's command user namespace (where its
# root holds every capability), then try to enter the namespaces whose
# descriptors are given. Prints one errno name per target.
ATTACKER = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fds = [int(x) for x in sys.argv[1:]]
if libc.setns(fds[0], 0x10000000) != 0:
    sys.exit("entering sandbox A failed: " + os.strerror(ctypes.get_errno()))
for fd in fds[1:]:
    r = libc.setns(fd, 0)
    print("ok" if r == 0 else errno.errorcode[ctypes.get_errno()])
"""


async def test_root_in_a_sandbox_cannot_enter_another_or_the_holder(mode: str) -> None:
    """Root of sandbox A, given descriptors of sandbox B's user, network and
    mount namespaces and of the holder's user namespace, enters none."""
    async with nsbox.Sandbox() as a, nsbox.Sandbox() as b:
        for sb in (a, b):
            await sb.exec(["sh", "-c", "sleep 60 >/dev/null 2>&1 &"])
        sleepers = {sb.id: process_named(sb.pid, "sleep") for sb in (a, b)}
        paths = [f"/proc/{sleepers[a.id].pid}/ns/user",  # A's command namespace: where A's root is
                 f"/proc/{sleepers[b.id].pid}/ns/user", f"/proc/{b.pid}/ns/user", f"/proc/{b.pid}/ns/net",
                 f"/proc/{b.pid}/ns/mnt", f"/proc/{sleepers[b.id].pid}/ns/mnt"]
        holders = _holders()
        if holders:
            paths.append(f"/proc/{holders[0].pid}/ns/user")
        fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
        try:
            r = subprocess.run([sys.executable, "-c", ATTACKER, *map(str, fds)], pass_fds=fds,
                               capture_output=True, text=True, timeout=30)
        finally:
            for fd in fds:
                os.close(fd)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["EPERM"] * (len(paths) - 1), (paths[1:], r.stdout)
        # Nor can A see or signal B's processes.
        await a.exec(["sh", "-c", "kill -9 -1"])
        # A's own sleeper takes a moment to die (SIGKILL is delivered, then
        # the process exits); one of B's, were it visible, would never go.
        for _ in range(100):
            r2 = await a.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
            if r2.stdout.count("sleep 60") == 0:
                break
            await anyio.sleep(0.05)
        assert r2.stdout.count("sleep 60") == 0, r2.stdout
        assert sleepers[b.id].is_running()


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_killed_holder_is_replaced(mode: str) -> None:
    if mode == "root":
        pytest.skip("real root uses no holder: maps are written directly")
    async with nsbox.Sandbox():
        [holder] = _holders()
    os.kill(holder.pid, 9)
    deadline = time.monotonic() + 10  # dead, not merely signalled (its exit is what is detected)
    while time.monotonic() < deadline and not _exited(holder.pid):
        await anyio.sleep(0.01)
    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["true"])).success
        [again] = _holders()
        assert again.pid != holder.pid
