"""`nsbox doctor`: passes here, and names the cause and the fix of each
failure it is shown.

Conditions that can be produced for real are: user namespaces disabled or
used up (a user namespace may lower its own user.max_user_namespaces), a
seccomp filter like Docker's (tests/seccomp_probe.c installs nsbox's own
filter, which refuses new user namespaces the way Docker's profile does), a
masked or read-only /proc (bind mounts over /proc in a user namespace, as
container runtimes make), a stale XDG_RUNTIME_DIR and a low RLIMIT_NOFILE.
The rest (AppArmor's restriction, kernel.unprivileged_userns_clone, old
kernels, NFS, cgroup layouts, a missing /dev/net/tun, the single-uid mode)
is simulated by pointing the doctor at fake sysctls and files, or by
replacing what its real attempts found.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest

from nsbox.cli import doctor
from nsbox.create import hostcheck
from nsbox.host import idmap

from tests.host.test_seccomp import probe_binary  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)

NAMES = ["kernel", "userns", "apparmor", "seccomp", "proc", "overlay", "idmap", "state", "nofile", "limits",
         "network", "sandbox"]
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


def in_userns(script: str) -> list[str]:
    """A prefix that runs the doctor at the end of `script`, as root of a
    new user (and mount) namespace: "$@" is the doctor's command."""
    return ["unshare", "-Urm", "sh", "-c", script, "sh"]


def assert_one_line(checks: dict[str, dict[str, Any]]) -> None:
    for c in checks.values():
        assert "\n" not in c["summary"] and "\n" not in (c["fix"] or ""), c
        if c["status"] != "pass":
            assert c["fix"] or c["name"] in ("sandbox", "proc", "overlay"), c


# ---- here ---------------------------------------------------------------

def test_doctor_passes_here(mode: str) -> None:
    status, checks, _ = run_doctor()
    assert status == 0, {n: c for n, c in checks.items() if c["status"] == "fail"}
    assert list(checks) == NAMES
    assert_one_line(checks)
    assert checks["sandbox"]["status"] == checks["userns"]["status"] == checks["proc"]["status"] == "pass"
    assert checks["idmap"]["status"] == ("warn" if mode == "single" else "pass")
    assert checks["idmap"]["details"]["mode"] == mode
    # /dev/net/tun is 0600 on this machine: a warning naming the fix, not a failure.
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        assert checks["network"]["status"] == "warn" and "chmod 0666 /dev/net/tun" in checks["network"]["fix"]


def test_text_output_names_each_check() -> None:
    r = subprocess.run([sys.executable, "-m", "nsbox.cli.doctor"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("nsbox can run here")
    for name in NAMES:
        assert any(line.split()[1:2] == [name] for line in lines), name
    assert isinstance(doctor.doctor, click.Command) and doctor.doctor.name == "doctor"


# ---- real failures ------------------------------------------------------

@pytest.fixture
def state_env(tmp_path: Path) -> dict[str, str]:
    # As root of a user namespace we need state directories of our own.
    return {"NSBOX_STATE_DIR": str(tmp_path / "state")}


def test_user_namespaces_disabled(state_env: dict[str, str]) -> None:
    status, checks, _ = run_doctor(
        wrap=in_userns('echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'), env=state_env)
    assert status == 1
    assert checks["userns"]["status"] == "fail"
    assert "user.max_user_namespaces=0" in checks["userns"]["summary"]
    assert "sysctl -w user.max_user_namespaces=" in checks["userns"]["fix"]
    assert checks["sandbox"]["status"] == "fail"
    assert_one_line(checks)


def test_user_namespaces_used_up(state_env: dict[str, str]) -> None:
    # The limit is 1 and another process holds the one namespace allowed.
    script = ('echo 1 > /proc/sys/user/max_user_namespaces || exit 99; unshare -U sleep 60 & holder=$!; '
              'while [ "$(readlink /proc/$holder/ns/user)" = "$(readlink /proc/self/ns/user)" ]; do sleep 0.05; done; '
              '"$@"; status=$?; kill $holder; exit $status')
    status, checks, _ = run_doctor(wrap=in_userns(script), env=state_env)
    assert status == 1
    assert "limit of 1 user namespaces" in checks["userns"]["summary"]
    assert "max_user_namespaces" in checks["userns"]["fix"]


def test_seccomp_filter_like_dockers(probe_binary: Path) -> None:  # noqa: F811
    # nsbox's own filter refuses new user namespaces as Docker's default
    # profile does: unshare gets EPERM, clone3 ENOSYS.
    status, checks, _ = run_doctor(wrap=[str(probe_binary), "--nnp", "default", "--"])
    assert status == 1
    userns = checks["userns"]
    assert userns["status"] == "fail" and "seccomp filter" in userns["summary"]
    assert "unshare: EPERM, clone3: ENOSYS" in userns["summary"]
    assert "seccomp=unconfined" in userns["fix"] or "Unconfined" in userns["fix"]
    assert checks["seccomp"]["status"] == "fail" and checks["seccomp"]["details"]["filters"] >= 1
    assert checks["sandbox"]["status"] == "fail"
    assert_one_line(checks)


@pytest.mark.parametrize("cover", [
    "mount --bind /dev/null /proc/timer_list",  # masked, as Docker masks /proc/timer_list
    "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys",  # read-only, as Docker's /proc/sys
], ids=["masked", "read-only"])
def test_masked_proc(cover: str, state_env: dict[str, str]) -> None:
    status, checks, _ = run_doctor(wrap=in_userns(f'{cover} && exec "$@"'), env=state_env)
    # nsbox still runs: its sandboxes get a masked bind of this /proc (nsbox/plan/procmask.py).
    assert status == 0, checks
    proc = checks["proc"]
    assert proc["status"] == "warn" and "refuses a fresh /proc" in proc["summary"]
    assert "a bind of this /proc" in proc["summary"] and checks["sandbox"]["status"] == "pass"
    assert "systempaths=unconfined" in proc["fix"] and "procMount: Unmasked" in proc["fix"]
    assert checks["userns"]["status"] == "pass"
    assert_one_line(checks)


@pytest.mark.parametrize("value, why", [
    ("/run/user/4242424", "cannot be used"),  # pam_slurm_adopt: no systemd user session made it
    ("/", "belongs to uid 0, not to you"),  # after `su`: someone else's
    ("OPEN", "is open to other users"),
    ("relative/dir", "is not an absolute path"),
])
def test_stale_xdg_runtime_dir(value: str, why: str, tmp_path: Path) -> None:
    if value == "/" and os.geteuid() == 0:
        pytest.skip("root owns /")
    if value == "OPEN":
        value = str(tmp_path)
        os.chmod(value, 0o777)
    status, checks, _ = run_doctor(env={"XDG_RUNTIME_DIR": value})
    assert status == 0
    state = checks["state"]
    assert state["status"] == "warn" and f"XDG_RUNTIME_DIR={value} {why}" in state["summary"]
    assert "unset XDG_RUNTIME_DIR" in state["fix"]


def test_unset_xdg_runtime_dir_is_fine() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    r = subprocess.run([sys.executable, "-m", "nsbox.cli.doctor", "--json"], capture_output=True, text=True,
                       timeout=90, env=env)
    state = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["state"]
    assert state["status"] == "pass" and "XDG_RUNTIME_DIR is unset" in state["summary"]


def _nofile(n: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def test_low_nofile_limit_warns() -> None:
    status, checks, _ = run_doctor(preexec_fn=_nofile(512))
    assert status == 0
    nofile = checks["nofile"]
    assert nofile["status"] == "warn" and "about 128 sandboxes" in nofile["summary"]
    assert "ulimit -Hn" in nofile["fix"] and "--propagate=NOFILE" in nofile["fix"]


def test_tiny_nofile_limit_fails() -> None:
    status, checks, _ = run_doctor(preexec_fn=_nofile(48))
    assert status == 1 and checks["nofile"]["status"] == "fail"


# ---- simulated hosts ------------------------------------------------------

def fake_sysctls(tmp_path: Path, values: dict[str, str]) -> Path:
    root = tmp_path / "sys"
    for name, value in values.items():
        path = root / name.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return root


def host_with(tmp_path: Path, sysctls: dict[str, str], probe: dict[str, str], sandbox_ok: bool,
              **kw: Any) -> doctor.Host:
    message = "created a sandbox" if sandbox_ok else "creating the sandbox's namespaces failed: Operation not permitted"
    return doctor.Host(proc_sys=fake_sysctls(tmp_path, sysctls), probe=lambda: probe,
                       sandbox=lambda: doctor.SandboxAttempt(sandbox_ok, message), **kw)


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
    monkeypatch.setattr(hostcheck, "fs_type", lambda path: "nfs4")
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
def fake_cgroups(tmp_path: Path, mounts: list[str], cgroup: str, files: dict[str, str]) -> doctor.Host:
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
    return doctor.Host(proc_self=proc_self, cgroup_root=root)


SCOPE = "user.slice/user-1000.slice/user@1000.service/app.slice/run-1.scope"


def test_limits_cgroup_v2_delegated(tmp_path: Path) -> None:
    host = fake_cgroups(tmp_path, ["35 25 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
                         f"0::/{SCOPE}\n",
                         {f"{SCOPE}/cgroup.controllers": "cpuset cpu io memory pids\n", f"{SCOPE}/cgroup.procs": ""})
    support = doctor.limit_support(host)
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
    support = doctor.limit_support(host)
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
    err = str(doctor.explain_clone_failure(28, host))
    assert "max_user_namespaces=0" in err and "sysctl -w user.max_user_namespaces" in err and "\n" not in err
    assert doctor.explain_clone_failure(1, host_with(tmp_path, {}, WORKING, True)) is None


def test_kernel_without_seccomp_filters(tmp_path: Path) -> None:
    proc_self = tmp_path / "self"
    proc_self.mkdir()
    (proc_self / "status").write_text("Name:\tpython\nNoNewPrivs:\t0\n")
    check = doctor.check_seccomp(doctor.Host(proc_self=proc_self), WORKING)
    assert check.status == "fail" and "CONFIG_SECCOMP_FILTER" in check.summary
