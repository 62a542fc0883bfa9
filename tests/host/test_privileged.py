"""`privileged`, as rootless podman means it: every capability of the
sandbox's own user namespace, no seccomp filter, nested user namespaces,
/sys mounted; never host root. Through each door (Sandbox(), nsbox.yaml,
`nsbox run --privileged`, compose `privileged: true`), and with the host's
promises kept in every identity mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nsbox
from nsbox.compose import ComposeError, load_project, service_spec
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment

from .test_security import _root_only_host_files

CAP_SYS_ADMIN = 21
PROBE = ("grep -E '^(CapEff|Seccomp):' /proc/self/status; ls /sys/class >/dev/null 2>&1 && echo sys-seen; "
         "unshare -rm sh -c 'mount -t tmpfs none /mnt && touch /mnt/x && echo nested-mount-ok' 2>&1")


def _status(out: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


async def _probe(sb: nsbox.Sandbox) -> tuple[str, dict[str, str]]:
    r = await sb.exec(["sh", "-c", PROBE])
    return r.stdout, _status(r.stdout)


async def test_privileged_nests_namespaces_mounts_and_sees_sys() -> None:
    async with nsbox.Sandbox(privileged=True) as sb:
        out, status = await _probe(sb)
        assert int(status["CapEff"], 16) >> CAP_SYS_ADMIN & 1, out
        assert status["Seccomp"] == "0", out  # no filter at all
        assert "sys-seen" in out and "nested-mount-ok" in out, out
        mounts = (await sb.exec(["cat", "/proc/self/mountinfo"])).stdout
        sysfs = [line for line in mounts.splitlines() if line.split()[4] == "/sys"]
        assert sysfs and " sysfs " in sysfs[0], sysfs
    async with nsbox.Sandbox() as sb:
        out, status = await _probe(sb)
        assert status["Seccomp"] == "2", out  # the filter
        assert "sys-seen" not in out and "nested-mount-ok" not in out, out


async def test_privileged_sharing_the_hosts_network_gets_a_read_only_sys() -> None:
    async with nsbox.Sandbox(privileged=True, network="host") as sb:
        out, _ = await _probe(sb)
        assert "sys-seen" in out and "nested-mount-ok" in out, out
        r = await sb.exec(["sh", "-c", "echo 1 > /sys/kernel/uevent_helper"])
        assert not r.success


async def test_privileged_keeps_the_hosts_promises(mode: str, tmp_path: Path) -> None:
    paths = [p for p in _root_only_host_files() if p != "/root"]
    assert paths, "no root-only file under /etc to test with"
    async with nsbox.Sandbox() as other, \
            nsbox.Sandbox(privileged=True) as sb:
        marker = f"nsbox-other-{os.getpid()}"
        await other.exec(["sh", "-c", f"exec -a {marker} sleep 600 >/dev/null 2>&1 &"])
        for path in paths:
            r = await sb.exec(["sh", "-c", f"cat {path} || ls {path}/"])
            assert not r.success and "Permission denied" in r.stderr, (path, r)
        # Neither the host's processes nor the other sandbox's are visible.
        r = await sb.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
        assert marker not in r.stdout and "pytest" not in r.stdout, r.stdout
        pids = (await sb.exec(["sh", "-c", "ls -d /proc/[0-9]* | wc -l"])).stdout.strip()
        assert int(pids) < 10, pids
        # Sandbox root is never host root: the id mapping is the one asked for.
        uid_map = Path(f"/proc/{sb.pid}/uid_map").read_text().split()
        if mode == "root":
            assert uid_map[0] == "0" and uid_map[1] != "0", uid_map
        else:
            assert uid_map[1] != "0", uid_map
        # Nested namespaces do not reach the host's: a mount made inside stays inside.
        r = await sb.exec(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs none /tmp && touch /tmp/{marker}"])
        assert r.success, r.stderr
        assert not Path(f"/tmp/{marker}").exists()


async def test_nsbox_yaml_privileged() -> None:
    envs = await NsboxSandboxEnvironment.sample_init("t", NsboxConfig(privileged=True), {})
    try:
        env = envs["default"].as_type(NsboxSandboxEnvironment)
        assert env.sandbox.spec.privileged
        r = await env.exec(["sh", "-c", PROBE])
        assert "nested-mount-ok" in r.stdout and _status(r.stdout)["Seccomp"] == "0", r.stdout
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("t", NsboxConfig(privileged=True), envs, False)


def test_cli_privileged_says_once_what_it_means() -> None:
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--privileged", "--", "sh", "-c",
                        "grep Seccomp: /proc/self/status"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["Seccomp:", "0"], r.stdout
    assert r.stderr.count("privileged here means") == 1 and "never host root" in r.stderr, r.stderr


def test_compose_privileged_maps_to_the_setting_and_not_to_host_root(tmp_path: Path) -> None:
    f = tmp_path / "compose.yaml"
    f.write_text(textwrap.dedent("""\
        services:
          app:
            image: busybox
            privileged: true
        """))
    project = load_project(f)
    spec = service_spec(project.services["app"], project, image="busybox", network="none")
    assert spec.privileged and spec.id_mapping == "auto"
    f.write_text(textwrap.dedent("""\
        services:
          app:
            image: busybox
            privileged: true
            x-nsbox: {id_mapping: host-root}
        """))
    with pytest.raises(ComposeError, match="x-nsbox: unknown setting id_mapping"):
        load_project(f)


def test_compose_privileged_honours_seccomp_unconfined(tmp_path: Path) -> None:
    f = tmp_path / "compose.yaml"
    f.write_text("services:\n  app:\n    image: busybox\n    privileged: true\n    security_opt: [seccomp=unconfined]\n")
    assert not [w for w in load_project(f).warnings if "seccomp" in w]
    f.write_text("services:\n  app:\n    image: busybox\n    security_opt: [seccomp=unconfined]\n")
    assert [w for w in load_project(f).warnings if "keeps its own seccomp deny-list" in w]


async def test_privileged_cannot_undo_masks_or_locks(tmp_path: Path) -> None:
    """No seccomp filter: the mount lock alone keeps read-only binds, the
    /proc masks and the /sys masks in place, from sandbox root and from a
    nested user namespace."""
    from nsbox.spec import Bind

    (tmp_path / "f").write_text("original\n")
    os.chmod(tmp_path, 0o755)
    attacks = ["umount -l /proc/timer_list", "umount -l /proc/sys", "mount -o remount,bind,rw /proc/sys",
               "umount -l /sys/firmware", "mount -o remount,rw /sys/firmware", "mount -o remount,bind,rw /data",
               "umount -l /data", "umount -l /usr", "mount -o remount,rw /usr"]
    async with nsbox.Sandbox(privileged=True, mounts=[Bind(str(tmp_path), "/data", readonly=True)]) as sb:
        for attack in attacks:
            for how in ("", "unshare -Urm "):
                r = await sb.exec(["sh", "-c", f"{how}sh -c '{attack}' && echo UNDONE; wc -c < /proc/timer_list; "
                                                f"ls /sys/firmware | wc -l; echo hacked > /data/f"])
                assert "UNDONE" not in r.stdout and r.stdout.split() == ["0", "0"], (how, attack, r)
    assert (tmp_path / "f").read_text() == "original\n"


async def test_privileged_compose_service_and_a_plain_one(tmp_path: Path) -> None:
    """A compose project through the Inspect provider: the privileged
    service nests namespaces and mounts, the other one cannot."""
    f = tmp_path / "compose.yaml"
    f.write_text(textwrap.dedent("""\
        services:
          default:
            image: host
            privileged: true
          plain:
            image: host
        """))
    project = load_project(f)
    for name, privileged in (("default", True), ("plain", False)):
        spec = service_spec(project.services[name], project, image="host", network="none")
        async with nsbox.Sandbox(spec=spec.replace(image=None)) as sb:
            out, status = await _probe(sb)
            assert ("nested-mount-ok" in out) is privileged and (status["Seccomp"] == "0") is privileged, (name, out)
