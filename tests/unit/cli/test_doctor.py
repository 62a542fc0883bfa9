"""`nsbox doctor`: names the cause and the fix of each failure it is shown,
on simulated hosts; tests/host/test_doctor.py has the conditions that can be
produced for real.

The rest (AppArmor's restriction, kernel.unprivileged_userns_clone, old
kernels, NFS, cgroup layouts, a missing /dev/net/tun, the single-uid mode)
is simulated by pointing the doctor at fake sysctls and files, or by
replacing what its real attempts found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nsbox.cli import doctor
from nsbox.create import hostcheck
from nsbox.host import idmap
from nsbox.host import probe as host_probe

pytestmark = pytest.mark.timeout(120)

WORKING: dict[str, str] = {"clone3": "ok", "userns": "ok", "idmap": "ok", "mntns": "ok", "proc": "ok",
                           "overlay": "ok"}


def run_doctor(*args: str, wrap: list[str] | None = None, env: dict[str, str] | None = None,
               preexec_fn: Callable[[], None] | None = None) -> tuple[int, dict[str, dict[str, Any]], str]:
    """Runs `python -m nsbox.cli.doctor --json` (inside `wrap`, a shell
    command's prefix); returns the exit status, the checks by name and stderr."""
    cmd = [sys.executable, "-m", "nsbox.cli.doctor", "--json", *args]
    r = subprocess.run([*(wrap or []), *cmd], capture_output=True, text=True, timeout=90,
                       env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        pytest.fail(f"no JSON from the doctor (status {r.returncode}):\n{r.stdout}\n{r.stderr}")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] == (r.returncode == 0)
    return r.returncode, checks, r.stderr


def assert_one_line(checks: dict[str, dict[str, Any]]) -> None:
    for c in checks.values():
        assert "\n" not in c["summary"] and "\n" not in (c["fix"] or ""), c
        if c["status"] != "pass":
            assert c["fix"] or c["name"] in ("sandbox", "proc", "overlay"), c


# ---- simulated hosts ------------------------------------------------------

def fake_sysctls(tmp_path: Path, values: dict[str, str]) -> Path:
    root = tmp_path / "sys"
    for name, value in values.items():
        path = root / name.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return root


def host_with(tmp_path: Path, sysctls: dict[str, str], probe: dict[str, str], sandbox_ok: bool,
              **kw: Any) -> host_probe.Host:
    message = "created a sandbox" if sandbox_ok else "creating the sandbox's namespaces failed: Operation not permitted"
    return host_probe.Host(proc_sys=fake_sysctls(tmp_path, sysctls), probe=lambda: probe,
                           sandbox=lambda: host_probe.SandboxAttempt(sandbox_ok, message), **kw)


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    out = {c.name: c for c in checks}
    assert_one_line({n: c.to_dict() for n, c in out.items()})
    return out


APPARMOR = {"kernel.apparmor_restrict_unprivileged_userns": "1", "user.max_user_namespaces": "63000"}


def test_apparmor_restriction(tmp_path: Path) -> None:
    # Ubuntu 24.04: the namespace is created but gets no capabilities, so
    # writing its id maps fails.
    probe = {"clone3": "ok", "userns": "ok", "idmap": "EPERM"}
    checks = by_name(doctor.run_checks(host_with(tmp_path, APPARMOR, probe, sandbox_ok=False)))
    for name in ("userns", "apparmor"):
        assert checks[name].status == "fail"
        assert "apparmor_restrict_unprivileged_userns=1" in checks[name].summary
        fix = checks[name].fix or ""
        assert "--apparmor-profile" in fix and "apparmor_parser -r" in fix
        assert "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0" in fix


def test_apparmor_restriction_with_nsbox_profile_installed(tmp_path: Path) -> None:
    probe = {"clone3": "ok", "userns": "ok", "idmap": "EPERM"}
    checks = by_name(doctor.run_checks(host_with(tmp_path, APPARMOR, probe, sandbox_ok=True)))
    assert checks["apparmor"].status == checks["userns"].status == "pass"
    assert "nsbox's helper can create user namespaces" in checks["userns"].summary


def test_apparmor_profile_names_this_installation() -> None:
    r = subprocess.run([sys.executable, "-m", "nsbox.cli.doctor", "--apparmor-profile"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    helper = str(doctor.helper_path())
    assert f"profile nsbox-create {helper} flags=(unconfined) {{" in r.stdout
    assert "  userns,\n" in r.stdout and "abi <abi/4.0>," in r.stdout
    shipped = Path(__file__).resolve().parents[3] / "contrib" / "apparmor" / "nsbox"
    if shipped.is_file():  # not in a staged copy of tests/
        assert "profile nsbox-create /" in shipped.read_text() and "  userns,\n" in shipped.read_text()


def test_unprivileged_userns_clone_disabled(tmp_path: Path) -> None:
    sysctls = {"kernel.unprivileged_userns_clone": "0", "user.max_user_namespaces": "63000"}
    checks = by_name(doctor.run_checks(host_with(tmp_path, sysctls, {"clone3": "EPERM", "userns": "EPERM"},
                                                 sandbox_ok=False, euid=1000)))
    assert checks["userns"].status == "fail"
    assert "kernel.unprivileged_userns_clone=0" in checks["userns"].summary
    assert "sysctl -w kernel.unprivileged_userns_clone=1" in (checks["userns"].fix or "")
    assert checks["proc"].status == checks["overlay"].status == "warn"  # untested, not failed


def test_few_user_namespaces_warn(tmp_path: Path) -> None:
    checks = by_name(doctor.run_checks(host_with(tmp_path, {"user.max_user_namespaces": "20"}, WORKING, True)))
    assert checks["userns"].status == "warn" and "about 10 sandboxes" in checks["userns"].summary


def test_old_kernel(tmp_path: Path) -> None:
    probe = {**WORKING, "overlay": "EINVAL"}
    checks = by_name(doctor.run_checks(host_with(tmp_path, {}, probe, True, kernel_release="5.10.0-28-amd64")))
    assert checks["kernel"].status == "fail" and "needs 5.12" in checks["kernel"].summary
    assert checks["overlay"].status == "fail" and "before Linux 5.11" in checks["overlay"].summary


def test_state_on_nfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_probe, "fs_type", lambda path: "nfs4")
    checks = by_name(doctor.run_checks(host_with(tmp_path, {}, {**WORKING, "overlay": "EINVAL"}, False)))
    assert checks["overlay"].status == "fail" and "on nfs4" in checks["overlay"].summary
    assert "NSBOX_STATE_DIR" in (checks["overlay"].fix or "")
    # Not a fixed name under /tmp, which another user could make first.
    assert "NSBOX_STATE_DIR=$(mktemp -d)" in (checks["overlay"].fix or "")
    assert "/tmp/$USER" not in (checks["overlay"].fix or "")


def test_state_dir_others_can_swap(tmp_path: Path) -> None:
    """NSBOX_STATE_DIR under a directory open to others (not sticky): they
    could swap its run/, data/ or cache/ for theirs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    status, checks, stderr = run_doctor(env={"NSBOX_STATE_DIR": str(shared / "state")})
    # The doctor's probes create sandboxes, whose first starts the collection
    # of dead sandboxes: refused too, it says nothing and ends cleanly.
    assert "Traceback" not in stderr, stderr
    assert status == 1 and checks["state"]["status"] == "fail", checks["state"]
    assert f"{shared} is writable by others" in checks["state"]["summary"]
    assert f"chmod go-w {shared}" in checks["state"]["fix"]
    assert not (shared / "state").exists()


def test_no_tun_device(tmp_path: Path) -> None:
    checks = by_name(doctor.run_checks(host_with(tmp_path, {}, WORKING, True, tun=tmp_path / "no-tun")))
    network = checks["network"]
    assert network.status == "warn" and "modprobe tun" in (network.fix or "")
    assert "none and host work" in network.summary


def test_single_uid_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    single = idmap.IdMap("single", ((0, 1000, 1),), ((0, 1000, 1),),
                         reason="newuidmap and newgidmap not found; " + idmap.SINGLE_FIX.format(name="u"))
    monkeypatch.setattr(idmap, "detect", lambda requested="auto": single)
    checks = by_name(doctor.run_checks(host_with(tmp_path, {}, WORKING, True)))
    check = checks["idmap"]
    assert check.status == "warn" and "newuidmap and newgidmap not found" in check.summary
    assert "exec(user=...)" in check.summary and "usermod --add-subuids" in (check.fix or "")


# Fake cgroup layouts: (mountinfo lines, /proc/self/cgroup, files to create).
def fake_cgroups(tmp_path: Path, mounts: list[str], cgroup: str, files: dict[str, str]) -> host_probe.Host:
    proc_self = tmp_path / "self"
    proc_self.mkdir()
    (proc_self / "mountinfo").write_text("".join(line + "\n" for line in mounts))
    (proc_self / "cgroup").write_text(cgroup)
    (proc_self / "status").write_text("Seccomp:\t0\nSeccomp_filters:\t0\n")
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return host_probe.Host(proc_self=proc_self, cgroup_root=root)


SCOPE = "user.slice/user-1000.slice/user@1000.service/app.slice/run-1.scope"


def test_limits_cgroup_v2_delegated(tmp_path: Path) -> None:
    host = fake_cgroups(tmp_path, ["35 25 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
                         f"0::/{SCOPE}\n",
                         {f"{SCOPE}/cgroup.controllers": "cpuset cpu io memory pids\n", f"{SCOPE}/cgroup.procs": ""})
    support = host_probe.limit_support(host)
    assert support.cgroup == "v2" and support.enforced == {"memory", "pids_limit", "cpus"}
    assert support.how["memory"].startswith("cgroup v2 memory.max")
    check = doctor.check_limits(host)
    assert check.status == "pass" and "memory: cgroup v2" in check.summary


def test_limits_cgroup_v2_without_delegation(tmp_path: Path) -> None:
    # Our cgroup has only the memory controller delegated, and pids/cpu are
    # missing: those fall back.
    host = fake_cgroups(tmp_path, ["35 25 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw"],
                         f"0::/{SCOPE}\n",
                         {f"{SCOPE}/cgroup.controllers": "memory\n", f"{SCOPE}/cgroup.procs": ""})
    check = doctor.check_limits(host)
    assert check.status == "warn" and "no cgroup for pids_limit, cpus" in check.summary
    assert "RLIMIT_NPROC" in check.summary and "systemd-run --user --scope -p Delegate=yes" in (check.fix or "")


def test_limits_cgroup_v1_as_root(tmp_path: Path) -> None:
    mounts = [f"{40 + i} 25 0:{50 + i} / /sys/fs/cgroup/{c} rw - cgroup cgroup rw,{c}"
              for i, c in enumerate(["memory", "pids", "cpu"])]
    host = fake_cgroups(tmp_path, mounts, "5:memory:/job\n4:pids:/job\n3:cpu:/job\n",
                         {f"{c}/job/cgroup.procs": "" for c in ("memory", "pids", "cpu")})
    support = host_probe.limit_support(host)
    assert support.cgroup == "v1" and support.enforced == {"memory", "pids_limit", "cpus"}
    assert "memory.limit_in_bytes" in support.how["memory"] and "cpu.cfs_quota_us" in support.how["cpus"]


def test_no_cgroups_at_all(tmp_path: Path) -> None:
    host = fake_cgroups(tmp_path, [], "", {})
    check = doctor.check_limits(host)
    assert check.status == "warn" and "cpus: not enforced" in check.summary
    assert "RLIMIT_AS" in check.details["how"]["memory"]  # type: ignore[index]
    # What the fallback cannot bound, and the way to refuse it, said plainly.
    assert "memory= cannot bound memfd or SysV shared memory, pipe or socket buffers" in check.summary
    assert "strict_limits refuses" in check.summary and "\n" not in check.summary
    assert "memfd" in check.details["how"]["memory"]  # type: ignore[index]


def test_clone_failure_is_explained(tmp_path: Path) -> None:
    host = host_with(tmp_path, {"user.max_user_namespaces": "0"}, {"clone3": "ENOSPC", "userns": "ENOSPC"}, False)
    err = str(hostcheck.explain_clone_failure(28, host))
    assert "max_user_namespaces=0" in err and "sysctl -w user.max_user_namespaces" in err and "\n" not in err
    assert hostcheck.explain_clone_failure(1, host_with(tmp_path, {}, WORKING, True)) is None


def test_kernel_without_seccomp_filters(tmp_path: Path) -> None:
    proc_self = tmp_path / "self"
    proc_self.mkdir()
    (proc_self / "status").write_text("Name:\tpython\nNoNewPrivs:\t0\n")
    check = doctor.check_seccomp(host_probe.Host(proc_self=proc_self), WORKING)
    assert check.status == "fail" and "CONFIG_SECCOMP_FILTER" in check.summary
