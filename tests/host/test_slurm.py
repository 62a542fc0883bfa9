"""SLURM, for real: an sbatch array job whose tasks each run an Inspect
eval with --sandbox nsbox, on a single-node cluster on this machine.

The cluster is Debian's slurm-wlm and munge, set up by
tests/slurm/setup.sh (CI runs it before the suite; as root this test runs
it too, and it does nothing when the cluster is up). The job always runs as
an unprivileged user, the way SLURM users run it:

- as root (a developer running pytest as root), the test submits as
  nsbox-sub (`runuser -u nsbox-sub -- sbatch`): the subuid identity mode.
  In the root pass of tests/run.sh it only starts the cluster and checks
  where it listens: the nsbox-sub pass runs the very same job next;
- not as root (the nsbox-sub and nsbox-single passes), it submits as the
  current user, which needs the cluster to be up already (the root pass or
  CI started it); otherwise it is skipped naming the fix (failed under
  CI=true). The nsbox-single pass so runs the job in the single-uid mode.

Where SLURM is absent it is skipped (tests/components.py), or deselect
it with `-m "not slurm"`.

The job's user cannot read this checkout (it may live under /root) nor a
pyenv Python, so the job script and the task file are copied into a
world-readable directory under /var/tmp, and the job runs the `inspect` of
a venv it can read: $NSBOX_TEST_STAGE/venv when NSBOX_TEST_STAGE is set,
else the venv running this test (tests/run.sh runs the suite from
$NSBOX_TEST_STAGE/venv).

Each array task is given an XDG_RUNTIME_DIR that nsbox cannot use (unset,
a missing /run/user/$UID as under pam_slurm_adopt, another user's
directory); the eval must still run, on nsbox's private fallback
directory. The test checks every task's log: the eval succeeded with
accuracy 1.0, and the bash tool ran in a sandbox whose PID 1 is nsbox-init.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parents[1] / "slurm"
SETUP = HERE / "setup.sh"
TASKS = 3  # --array=0-2
WAIT = 90  # seconds for the whole array to finish (it takes ~10 s here)
JOB_USER_AS_ROOT = "nsbox-sub"
NOT_UP = ("no SLURM cluster is up here{why}: as root, run tests/slurm/setup.sh (needs `apt-get install "
          "slurm-wlm munge`; .ci/run does both), or deselect this test with -m 'not slurm'")

with warnings.catch_warnings():
    # Until `slurm` is registered in pyproject.toml's [tool.pytest.ini_options]
    # markers, pytest warns that it does not know it.
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    # needs("slurm"): skipped where SLURM is not installed (as root) or no
    # cluster is up (not as root); failed there under CI=true.
    pytestmark = [pytest.mark.slurm, pytest.mark.needs("slurm"), pytest.mark.timeout(WAIT + 120)]


# Daemons and runuser live in sbin, which tests/run.sh's PATH leaves out.
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def which(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def run(cmd: list[str], timeout: float = 30, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, **kw)


class JobUser:
    """Who submits the job, and how to run a command as them with a clean
    environment (nothing of this test's, e.g. NSBOX_STATE_DIR, leaks in)."""

    def __init__(self) -> None:
        if os.geteuid() == 0:
            try:
                self.pw = pwd.getpwnam(JOB_USER_AS_ROOT)
            except KeyError:
                pytest.fail(f"user {JOB_USER_AS_ROOT} is missing: tests/run.sh creates it "
                            f"(or: useradd --create-home {JOB_USER_AS_ROOT})")
        else:
            self.pw = pwd.getpwuid(os.geteuid())
        self.name, self.uid = self.pw.pw_name, self.pw.pw_uid

    def cmd(self, argv: list[str]) -> list[str]:
        env = ["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={self.pw.pw_dir}", "LANG=C.UTF-8",
               f"USER={self.name}", f"LOGNAME={self.name}"]
        prefix = [which("runuser") or "runuser", "-u", self.name, "--"] if os.geteuid() == 0 else []
        return [*prefix, *env, *argv]


def job_venv(user: JobUser) -> Path:
    stage = os.environ.get("NSBOX_TEST_STAGE")
    venv = Path(stage) / "venv" if stage else Path(sys.prefix)
    why = ("set NSBOX_TEST_STAGE to a directory staged by tests/run.sh (it holds venv/), e.g. "
           "NSBOX_TEST_STAGE=/var/tmp/nsbox-test; or run `NSBOX_TEST_STAGE=/var/tmp/nsbox-test-slurm "
           "bash tests/run.sh tests/host/test_slurm.py`")
    if not stage and sys.prefix == sys.base_prefix:
        pytest.fail(f"the SLURM job needs a venv that {user.name} can read, and this Python is not a venv: {why}")
    if not (venv / "bin" / "inspect").is_file():
        pytest.fail(f"{venv} has no bin/inspect: {why}")
    r = run(user.cmd([str(venv / "bin" / "python"), "-c", "import nsbox"]), cwd="/")
    if r.returncode != 0:
        pytest.fail(f"{user.name} cannot use {venv} ({r.stderr.strip().splitlines()[-1:]}): {why}")
    return venv


def node_state() -> str:
    if shutil.which("sinfo") is None:
        return "sinfo is missing"
    r = run(["sinfo", "-h", "-N", "-o", "%T"], timeout=15)
    return r.stdout.strip() if r.returncode == 0 else (r.stderr.strip() or f"sinfo exit {r.returncode}")


def ensure_cluster() -> None:
    if os.geteuid() == 0:
        if which("slurmctld") is None:
            pytest.fail(NOT_UP.format(why=" (slurmctld is not installed)"))
        r = run(["bash", str(SETUP)], timeout=120, env={**os.environ, "PATH": SBIN_PATH})
        if r.returncode != 0:
            pytest.fail(f"tests/slurm/setup.sh failed (exit {r.returncode}):\n{r.stderr}")
    state = node_state()
    if not any(s in ("idle", "mixed", "allocated", "completing") for s in state.split()):
        pytest.fail(NOT_UP.format(why=f" (sinfo: {state!r})"))


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A world-readable copy of the job script and task, and an output
    directory that belongs to the job's user."""
    d = Path(tempfile.mkdtemp(prefix="nsbox-slurm-", dir="/var/tmp"))
    try:
        os.chmod(d, 0o755)
        shutil.copyfile(HERE / "job.sh", d / "job.sh")
        shutil.copyfile(HERE / "task.py", d / "task.py")
        os.chmod(d / "job.sh", 0o755)
        os.chmod(d / "task.py", 0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def queued(job_id: str) -> list[str]:
    r = run(["squeue", "-h", "-j", job_id, "-o", "%i %T %R"], timeout=15)
    if r.returncode != 0 and "Invalid job id" in r.stderr:
        return []  # finished and already purged
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                out.append(addr)
    return out


def test_sbatch_array_runs_inspect_evals_in_nsbox(workdir: Path, mode: str) -> None:
    user = JobUser()
    if user.uid == 0:
        pytest.fail("the job must run as an unprivileged user")
    venv = job_venv(user)
    ensure_cluster()
    # slurmd listens on loopback only (CommunicationParameters=NoInAddrAny
    # with NodeAddr=127.0.0.1).
    assert listeners(6818) and set(listeners(6818)) <= {"0100007F", "00000000000000000000000001000000"}, \
        listeners(6818)
    if os.geteuid() == 0 and os.environ.get("NSBOX_TEST_EXPECT_MODE") == "root":
        return  # tests/run.sh's root pass: its nsbox-sub pass submits the same job as nsbox-sub

    out = workdir / "out"
    out.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(out, user.uid, user.pw.pw_gid)
    r = run(user.cmd(["sbatch", "--parsable", f"--array=0-{TASKS - 1}", "--job-name=nsbox-slurm-test",
                      f"--chdir={out}", f"--output={out}/task-%a.log", "--time=5", "--ntasks=1",
                      "--cpus-per-task=1", str(workdir / "job.sh"), str(venv), str(workdir / "task.py"), str(out)]),
            cwd=workdir)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    job_id = r.stdout.strip().split(";")[0]
    assert job_id.isdigit(), r.stdout

    finished = False
    started = time.monotonic()
    try:
        while queued(job_id):
            if time.monotonic() - started > WAIT:
                pytest.fail(f"job {job_id} still queued after {WAIT}s: {queued(job_id)}\n{task_logs(out)}")
            time.sleep(0.5)
        finished = True
    finally:
        if not finished:  # timed out or interrupted: leave nothing queued
            subprocess.run(["scancel", job_id], timeout=15, check=False)
    elapsed = time.monotonic() - started
    print(f"\nSLURM array job {job_id} ({TASKS} tasks, as {user.name}) finished in {elapsed:.1f}s")

    from inspect_ai.log import read_eval_log

    expected_mode = "subuid" if os.geteuid() == 0 else mode
    for i in range(TASKS):
        log_text = (out / f"task-{i}.log").read_text() if (out / f"task-{i}.log").exists() else "(no log)"
        status = out / f"status-{i}"
        assert status.exists() and status.read_text().strip() == "0", f"array task {i} failed:\n{log_text}"
        eval_files = list((out / f"logs-{i}").glob("*.json"))
        assert len(eval_files) == 1, f"array task {i} wrote {len(eval_files)} eval logs:\n{log_text}"
        log = read_eval_log(str(eval_files[0]))
        assert log.status == "success", (log.error, log_text)
        assert log.eval.sandbox is not None and log.eval.sandbox.type == "nsbox", log.eval.sandbox
        assert log.results is not None and log.results.scores[0].metrics["accuracy"].value == 1.0, log_text
        [sample] = log.samples or []
        assert sample.error is None and sample.scores is not None, sample.error
        score = sample.scores["ran_in_nsbox"]
        meta = score.metadata or {}
        # The bash tool wrote PID 1's name; the scorer read it back.
        assert meta["written"] == meta["pid1"] == "nsbox-init", score.explanation
        assert meta["nsbox_sandbox_id"], meta
        assert meta["array_task"] == str(i) and meta["uid"] == user.uid, meta
        assert meta["id_mode"] == expected_mode, meta
        # The XDG_RUNTIME_DIR the job gave was unusable; nsbox fell back to
        # a private directory of its own.
        xdg = meta["xdg_runtime_dir"]
        assert (xdg is None) == (i % 3 == 0), meta
        assert Path(meta["runtime_dir"]).name == f"nsbox-{user.uid}", meta
        assert xdg is None or not meta["runtime_dir"].startswith(xdg.rstrip("/") + "/"), meta
        assert f"XDG_RUNTIME_DIR={xdg or '<unset>'}" in log_text, log_text


def task_logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("task-*.log")))
