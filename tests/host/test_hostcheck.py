"""Host prerequisites: a failure must say what is wrong and how to fix it, on one line."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsbox.create import hostcheck, zygote
from nsbox.host import probe as host_probe
from nsbox.plan import steps


def test_refused_user_namespaces_name_the_sysctl(tmp_path: Path) -> None:
    # A real refusal: inside a user namespace whose user.max_user_namespaces
    # is 0, the kernel refuses to create more (this works for any user).
    # There we appear as uid 0, so we need state directories of our own.
    script = (f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -m nsbox run -- true")
    env = {**os.environ, "NSBOX_STATE_DIR": str(tmp_path)}
    r = subprocess.run(["unshare", "-Ur", "sh", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 125
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "user.max_user_namespaces=0" in lines[0]  # the cause, found by probing (nsbox doctor)
    assert "sysctl -w user.max_user_namespaces=" in lines[0]


@pytest.mark.parametrize("sysctl, container, expected", [
    ({"kernel.unprivileged_userns_clone": "0"}, None, "sysctl -w kernel.unprivileged_userns_clone=1"),
    ({"user.max_user_namespaces": "0"}, None, "sysctl -w user.max_user_namespaces=15000"),
    ({"kernel.apparmor_restrict_unprivileged_userns": "1"}, None, "apparmor_restrict_unprivileged_userns=0"),
    ({}, "Docker", "--security-opt seccomp=unconfined"),
    ({}, "Kubernetes", "seccompProfile.type: Unconfined"),
])
def test_each_cause_gets_its_fix(monkeypatch: pytest.MonkeyPatch, sysctl: dict[str, str], container: str | None,
                                 expected: str) -> None:
    monkeypatch.setattr(host_probe, "sysctl", lambda name, proc_sys=None: sysctl.get(name))
    monkeypatch.setattr(host_probe, "in_container", lambda: container)
    err = hostcheck.clone_failed(errno.EPERM)
    assert expected in str(err) and "\n" not in str(err)


def test_masked_proc_and_network_filesystems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_probe, "sysctl", lambda name, proc_sys=None: None)
    proc = steps.mount("proc", "/x/proc", "proc", (), None, "mount a fresh /proc")
    assert "systempaths=unconfined" in str(hostcheck.step_failed(proc, errno.EPERM, "/layer"))
    overlay = steps.mount("overlay", "/x", "overlay", (), "lowerdir=/a", "mount the root filesystem")
    monkeypatch.setattr(host_probe, "fs_type", lambda path: "nfs4")
    err = str(hostcheck.step_failed(overlay, errno.EINVAL, "/home/u/.local/share/nsbox/sandboxes/x"))
    assert "is on nfs4" in err and "NSBOX_STATE_DIR" in err and "\n" not in err


def test_old_kernels_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    err = str(hostcheck.clone_failed(errno.EINVAL))
    assert "5.12" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("helper", ["not executable", "missing"])
def test_a_helper_that_cannot_start_is_named(tmp_path: Path, helper: str) -> None:
    """nsbox-create that cannot be started (a broken install) is named, with
    the fix: not "user namespaces are not available", which a failure to
    start it had read as."""
    path = tmp_path / "nsbox-create"
    if helper == "not executable":
        path.write_text("not a program\n")
    code = ("import anyio, os, sys, nsbox\n"
            "from nsbox.create import zygote\n"
            "zygote.CREATE_HELPER = os.fsencode(sys.argv[1])\n"
            "async def main():\n"
            "    try:\n"
            "        async with nsbox.Sandbox():\n"
            "            pass\n"
            "    except nsbox.NsboxError as e:\n"
            "        print(type(e).__name__, e)\n"
            "anyio.run(main)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=50,
                       env={**os.environ, "NSBOX_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"SandboxSetupError cannot start {path}: "), r.stdout
    assert "reinstall nsbox" in r.stdout and "namespace" not in r.stdout, r.stdout
