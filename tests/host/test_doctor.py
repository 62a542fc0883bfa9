"""`nsbox doctor`: passes here, and names the cause and the fix of each
failure that can be produced for real (tests/unit/cli/test_doctor.py has the
simulated ones).

Conditions that can be produced for real are: user namespaces disabled or
used up (a user namespace may lower its own user.max_user_namespaces), a
seccomp filter like Docker's (tests/seccomp_probe.c installs nsbox's own
filter, which refuses new user namespaces the way Docker's profile does), a
masked or read-only /proc (bind mounts over /proc in a user namespace, as
container runtimes make), a stale XDG_RUNTIME_DIR and a low RLIMIT_NOFILE.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import click
import pytest

from nsbox.cli import doctor

from tests.host.test_seccomp import probe_binary  # noqa: F401  (the fixture)
from tests.unit.cli.test_doctor import assert_one_line, run_doctor

pytestmark = pytest.mark.timeout(120)

NAMES = ["kernel", "userns", "apparmor", "seccomp", "proc", "overlay", "idmap", "state", "nofile", "limits",
         "network", "sandbox"]


def in_userns(script: str) -> list[str]:
    """A prefix that runs the doctor at the end of `script`, as root of a
    new user (and mount) namespace: "$@" is the doctor's command."""
    return ["unshare", "-Urm", "sh", "-c", script, "sh"]


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
