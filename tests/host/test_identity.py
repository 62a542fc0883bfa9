"""Identity mapping: what each mode allows inside the sandbox, and why.

These tests expect different things per mode; `mode` is the mode of the
user running this pytest (tests/run.sh runs all three).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import nsbox
from nsbox import UserUnsupported
from nsbox.host import idmap

# Inspect's root probe reads these (see Inspect's sandbox-tools root access).
PROBE = "grep -E '^(Uid|CapEff):' /proc/self/status; cat /proc/self/setgroups"


async def test_sandbox_root_is_the_invoking_user(sandbox: nsbox.Sandbox) -> None:
    await sandbox.write_file("/var/tmp/owned", "x")
    r = await sandbox.exec(["stat", "-c", "%u", "/var/tmp/owned"])
    assert r.stdout == "0\n"
    # The init's user namespace maps sandbox root onto us (real root: onto
    # a subordinate id, never onto host root)...
    with open(f"/proc/{sandbox.pid}/uid_map") as f:
        uid_map = f.read().split()
    assert sandbox.idmap is not None
    outside = os.geteuid() or sandbox.idmap.host_root[0]
    assert outside != 0
    assert uid_map[:3] == ["0", str(outside), "1" if os.geteuid() else str(idmap.ROOT_RANGE)]
    # ...and sandbox processes live in a nested one that maps ids to themselves.
    nested = (await sandbox.exec(["cat", "/proc/self/uid_map"])).stdout.split()
    assert nested[:2] == ["0", "0"]


async def test_users_are_looked_up_in_identity_files_of_a_bounded_size(sandbox: nsbox.Sandbox) -> None:
    """The sandbox writes its /etc/passwd, and every exec as a named user
    reads and scans it on the host: a file over 1 MiB is refused in one
    line (it had held the host's event loop for seconds per exec)."""
    filler = "".join(f"u{i}:x:{5000 + i}:{5000 + i}::/home/u{i}:/bin/sh\n" for i in range(20000))
    assert 1 << 20 > len(filler) > 800_000
    await sandbox.exec(["sh", "-c", "cat >> /etc/passwd && echo 'last:x:0:0::/last:/bin/sh' >> /etc/passwd"],
                       input=filler)
    r = await sandbox.exec(["sh", "-c", "echo $HOME"], user="last")  # found at the end of a large file
    assert (r.returncode, r.stdout) == (0, "/last\n"), r
    await sandbox.exec(["sh", "-c", "cat >> /etc/passwd"], input=filler)
    with pytest.raises(UserUnsupported, match=r"cannot look users up in the sandbox's /etc/passwd: "
                                              r"it is larger than 1 MiB"):
        await sandbox.exec(["id"], user="last")
    assert (await sandbox.exec(["id", "-u"])).stdout == "0\n"  # the default user needs no lookup


@pytest.mark.parametrize("replace", ["mkdir /etc/passwd", "mkfifo /etc/passwd"])
async def test_identity_files_that_are_not_files_name_no_users(sandbox: nsbox.Sandbox, replace: str) -> None:
    """An image whose /etc/passwd is a directory or a FIFO runs as root,
    as in Docker; a named user is not found (it had been a traceback)."""
    await sandbox.exec(["sh", "-c", f"rm /etc/passwd && {replace}"])
    r = await sandbox.exec(["id", "-u"], user="0")
    assert (r.returncode, r.stdout) == (0, "0\n"), r
    r = await sandbox.exec(["id"], user="nobody")
    assert r.returncode == 126 and "unable to find user nobody" in r.stderr, r


async def test_a_working_directory_its_user_cannot_enter_is_one_line(debian_rootfs: Path, mode: str) -> None:
    """As `docker run -u nobody -w /root` fails: it had been a bare
    PermissionError traceback."""
    box = nsbox.Sandbox(debian_rootfs, user="nobody", workdir="/root")
    if mode == "single":  # only root is mapped: nobody is refused before
        with pytest.raises(UserUnsupported):
            await box.start()
        return
    with pytest.raises(nsbox.SandboxSetupError, match=r"the working directory /root is not open to nobody"):
        await box.start()


async def test_users_and_root_probe(debian: nsbox.Sandbox, mode: str) -> None:
    r = await debian.exec(["sh", "-c", PROBE], user="root")
    fields = dict(line.split(":", 1) for line in r.stdout.splitlines()[:2])
    assert fields["Uid"].split()[0] == "0"
    caps = int(fields["CapEff"], 16)
    assert caps & (1 << 6) and caps & (1 << 7)  # CAP_SETGID, CAP_SETUID
    setgroups = r.stdout.splitlines()[2]
    if mode == "single":
        # The kernel requires setgroups to be denied for an unprivileged
        # single-id map: Inspect's probe then says "unusable", correctly.
        assert setgroups == "deny"
        with pytest.raises(UserUnsupported, match="subordinate id range"):
            await debian.exec(["whoami"], user="nobody")
        return
    assert setgroups == "allow"
    add = await debian.exec(["adduser", "--disabled-password", "--comment", "", "alice"], timeout=60)
    assert add.success, add.stderr
    assert (await debian.exec(["whoami"], user="alice")).stdout == "alice\n"
    assert (await debian.exec(["su", "-s", "/bin/sh", "-c", "id -un", "alice"])).stdout == "alice\n"
    home = await debian.exec(["stat", "-c", "%U %a", "/home/alice"])
    assert home.stdout.split()[0] == "alice"
    # Permissions hold between sandbox users.
    await debian.exec(["sh", "-c", "echo secret > /root/only-root && chmod 600 /root/only-root"])
    assert not (await debian.exec(["cat", "/root/only-root"], user="alice")).success
    assert (await debian.exec(["userdel", "-r", "alice"])).success


async def test_forced_single_mapping() -> None:
    # Any user can ask for the single-id fallback; it must behave as such.
    async with nsbox.Sandbox(id_mapping="single") as sb:
        assert sb.idmap is not None and sb.idmap.mode == "single"
        assert (await sb.exec(["id", "-u"])).stdout == "0\n"
        with pytest.raises(UserUnsupported):
            await sb.exec(["id"], user="nobody")


def test_mode_matches_the_host_configuration(mode: str) -> None:
    m = idmap.detect()
    if os.geteuid() == 0:
        assert mode == "root"
    elif mode == "subuid":
        assert m.uid_map[0] == (0, os.geteuid(), 1) and m.uid_map[1][0] == 1 and m.size > 65535
    else:
        assert mode == "single" and "usermod --add-subuids" in m.reason


async def test_inspect_root_probe_verdict(mode: str) -> None:
    # Inspect's own probe decides whether its tools may run as root.
    from inspect_ai.tool._sandbox_tools_utils.sandbox import resolve_root_access

    from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment

    cfg = NsboxConfig()
    envs = await NsboxSandboxEnvironment.sample_init("probe", cfg, {})
    try:
        verdict = await resolve_root_access(envs["default"])
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("probe", cfg, envs, False)
    # With one mapped id, setgroups must be denied: "unusable" is right then.
    assert verdict.state == ("unusable" if mode == "single" else "usable"), verdict.reason


def test_no_new_privs_falls_back_to_single(mode: str) -> None:
    # Under no_new_privs (Kubernetes' allowPrivilegeEscalation: false) the
    # setuid newuidmap cannot write maps: a user with a subuid range gets
    # the single-uid mode, saying why, instead of a failed sandbox.
    import subprocess
    import sys

    probe = "from nsbox.host import idmap; m = idmap.detect(); print(m.mode); print(m.reason)"
    r = subprocess.run(["setpriv", "--no-new-privs", sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    got, reason = r.stdout.splitlines()[:2]
    if mode == "subuid":
        assert got == "single" and "no_new_privs" in reason
    else:
        assert got == mode  # root writes its maps itself; single has nothing to lose
