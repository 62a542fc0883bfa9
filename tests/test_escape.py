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
from nsbox.rootfs import Bind

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
