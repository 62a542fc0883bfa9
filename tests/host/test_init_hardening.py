"""The init (PID 1 of a sandbox) against its own sandbox, and against running
out of descriptors; the setup's host directories against its later steps.

1. Sandbox root has the init's ids (the nested user namespace maps the same
   ones), so without the seccomp filter's checks it could set the init's
   resource limits (inherited by every later command: fsize 0 breaks every
   write) and its scheduling. The filter refuses those calls on process 1
   (csrc/init/seccomp.c); on the caller itself they keep working. And each
   command gets the limits the init started with (csrc/init/child.c).
2. An init out of descriptors neither spins on its listening socket nor
   leaves the host waiting (csrc/init/main.c: turn_away, serve_conn).
3. The descriptors of the host directories the setup looked up (PATH_FD
   steps) are closed at the pivot: a step after it cannot reach a host
   directory through /proc/self/fd (csrc/create/child.c).
"""

from __future__ import annotations

import errno
import os
import resource
import struct
import time
from pathlib import Path

import anyio
import pytest

import nsbox
from nsbox.create import zygote
from nsbox.errors import CommandTimeout, NsboxError
from nsbox.host import idmap
from nsbox.plan import steps

pytestmark = pytest.mark.timeout(120)


# ---- 1. the init's limits and scheduling -------------------------------------

async def test_sandbox_root_cannot_set_the_inits_resource_limits() -> None:
    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["id", "-u"])).stdout == "0\n"
        before = (await sb.exec(["cat", "/proc/1/limits"])).stdout
        for limit in ("--fsize=0:0", "--cpu=1:1", "--nofile=6:6"):
            r = await sb.exec(["prlimit", "--pid", "1", limit])
            assert r.returncode != 0, (limit, r.stdout, r.stderr)
        assert (await sb.exec(["cat", "/proc/1/limits"])).stdout == before
        # Had fsize 0 reached the init, this write would die of SIGXFSZ (153).
        r = await sb.exec(["sh", "-c", "echo hi > /tmp/x && cat /tmp/x"])
        assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr
        # Reading the init's limits is harmless and stays allowed.
        r = await sb.exec(["prlimit", "--pid", "1", "--nofile"])
        assert r.returncode == 0, r.stderr
        # A process's own limits, by its pid or as itself.
        r = await sb.exec(["sh", "-c", "prlimit --pid $$ --nofile=100:100 && ulimit -n && ulimit -f 1000 && ulimit -f"])
        assert (r.returncode, r.stdout) == (0, "100\n1000\n"), r.stderr


async def test_commands_get_the_limits_the_init_started_with() -> None:
    """Limits set on the init after it started (here from the host, soft
    only, since the filter keeps sandbox root out) do not reach commands:
    each gets the init's startup limits back before its exec."""
    async with nsbox.Sandbox() as sb:
        await sb.exec(["true"])  # the init has started, and recorded its limits
        soft, hard = resource.prlimit(sb.pid, resource.RLIMIT_FSIZE)
        try:
            resource.prlimit(sb.pid, resource.RLIMIT_FSIZE, (0, hard))
        except PermissionError:
            pytest.skip("setting the init's RLIMIT_FSIZE from outside is not permitted here (needs root, or the "
                        "owner of the sandbox's user namespace)")
        r = await sb.exec(["sh", "-c", "echo hi > /tmp/x && cat /tmp/x"])
        assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr
        r = await sb.exec(["sh", "-c", "ulimit -f"])
        assert r.stdout.strip() == ("unlimited" if soft == resource.RLIM_INFINITY else str(soft // 512))


def _sched(pid: int) -> tuple[str, str, set[int]]:
    """The nice value and scheduling policy (/proc/PID/stat) and CPU
    affinity of a host process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields 19 and 41 of proc(5), counted from 1; the list starts at 3.
    return fields[16], fields[38], os.sched_getaffinity(pid)


async def test_sandbox_root_cannot_change_the_inits_scheduling() -> None:
    async with nsbox.Sandbox() as sb:
        before = _sched(sb.pid)
        for cmd in (["chrt", "-i", "-p", "0", "1"], ["renice", "-n", "19", "-p", "1"],
                    ["taskset", "-p", "1", "1"], ["ionice", "-c", "3", "-p", "1"],
                    # Process group 1 (the init's) and a user (the init's ids).
                    ["renice", "-n", "19", "-g", "1"], ["renice", "-n", "19", "-u", "0"],
                    ["ionice", "-c", "3", "-P", "1"], ["ionice", "-c", "3", "-u", "0"]):
            r = await sb.exec(cmd)
            assert r.returncode != 0, (cmd, r.stdout, r.stderr)
        assert _sched(sb.pid) == before
        # On itself (its pid, or pid 0) a command still may.
        r = await sb.exec(["sh", "-c", "renice -n 5 -p $$ && chrt -i -p 0 $$ && taskset -p 1 $$ && "
                                       "ionice -c 3 -p $$ && chrt -p $$ && ionice -p $$ && nice -n 2 true"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert "SCHED_IDLE" in r.stdout and "idle" in r.stdout


# ---- 2. out of descriptors ---------------------------------------------------

def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _idle_ticks(pid: int, seconds: float = 1.0) -> int:
    """CPU ticks (USER_HZ, 100 a second) `pid` used in `seconds`: a spinning
    process uses all of them."""
    before = _cpu_ticks(pid)
    time.sleep(seconds)
    return _cpu_ticks(pid) - before


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _drop_connection(sb: nsbox.Sandbox) -> None:
    """Closes the host's connection to the init and waits until the init
    has closed its end: the next request comes on a new connection."""
    before, connected = _open_fds(sb.pid), sb.client.connected
    sb.client.disconnect()
    deadline = time.monotonic() + 5
    while connected and _open_fds(sb.pid) >= before:
        assert time.monotonic() < deadline, "the init kept a closed connection"
        await anyio.sleep(0.01)


def _set_soft_nofile(pid: int, soft: int) -> None:
    """Sets the init's soft RLIMIT_NOFILE from outside (its hard limit
    stays, so the test can raise the soft one back)."""
    hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    except PermissionError:
        pytest.skip("setting the init's RLIMIT_NOFILE from outside is not permitted here (needs root, or the "
                    "owner of the sandbox's user namespace)")


@pytest.mark.once  # the init's own answer once set up, the same code in every mode (8 s)
async def test_an_init_out_of_descriptors_turns_clients_away_without_spinning() -> None:
    async with nsbox.Sandbox() as sb:
        pid = sb.pid
        await sb.exec(["true"])
        await _drop_connection(sb)
        soft = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
        held = _open_fds(pid)
        try:
            # Every descriptor the init may have is taken: it cannot accept
            # the connection by itself.
            _set_soft_nofile(pid, held)
            start = time.monotonic()
            with pytest.raises(NsboxError):
                await sb.exec(["true"], timeout=8)
            assert time.monotonic() - start < 5, "the host waited for an answer"
            assert _idle_ticks(pid) < 10, "the init spins while idle"
            # Below every descriptor it opened itself (0-4 are the standard
            # ones, the lifeline and the listener): nothing can be accepted,
            # the host waits (its timeout), and the init still does not spin.
            _set_soft_nofile(pid, 5)  # (the client reconnects: the init closed the connection it turned away)
            with pytest.raises(CommandTimeout):
                await sb.exec(["true"], timeout=1)
            assert _idle_ticks(pid) < 10, "the init spins while idle"
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
        # Room again: the init listens again (on a new connection: the one
        # that timed out may never have been accepted).
        sb.client.disconnect()
        r = await sb.exec(["echo", "ok"], timeout=10)
        assert r.stdout == "ok\n"


async def test_a_connection_the_init_turned_away_is_made_again() -> None:
    """The init, out of descriptors, accepts a connection and closes it: the
    next request finds it closed. That is not the sandbox's end (which the
    host had reported, "its init has exited"): it connects again."""
    async with nsbox.Sandbox() as sb:
        pid = sb.pid
        await sb.exec(["true"])
        await _drop_connection(sb)
        soft = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
        try:
            _set_soft_nofile(pid, _open_fds(pid))
            with pytest.raises(NsboxError):
                await sb.exec(["true"], timeout=8)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
        # A control request (answered on the connection itself, so not sent
        # again) on the connection the init closed fails at most once: the
        # next one connects again. So does a command.
        for _ in range(2):
            try:
                assert (await sb.status())["running"] == 0
                break
            except NsboxError:
                continue
        else:
            pytest.fail("a control request kept failing on the connection the init had closed")
        r = await sb.exec(["echo", "ok"], timeout=10)
        assert r.stdout == "ok\n"


async def test_a_request_whose_descriptors_were_cut_off_is_refused() -> None:
    async with nsbox.Sandbox() as sb:
        pid = sb.pid
        await sb.exec(["true"])  # the connection is open, and accepted
        soft = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
        try:
            # Room for one descriptor of the request's, its channel: the
            # kernel drops the others (MSG_CTRUNC).
            _set_soft_nofile(pid, _open_fds(pid) + 1)
            start = time.monotonic()
            with pytest.raises(NsboxError) as e:
                await sb.exec(["true"], timeout=8)
            assert time.monotonic() - start < 5
            assert os.strerror(errno.EMFILE) in str(e.value)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
        # The same connection serves the next request.
        r = await sb.exec(["echo", "ok"], timeout=10)
        assert r.stdout == "ok\n"


# ---- 3. the setup's host directories -------------------------------------------

def test_steps_after_the_pivot_cannot_reach_the_host_directories_of_the_setup(tmp_path: Path) -> None:
    """A plan laid out like nsbox's (host directories held open by PATH_FD
    steps, the new root named through one), then an INSIDE step naming
    /proc/self/fd/200, as a symlink swapped into a bound host directory
    would: it must find nothing there."""
    layer = tmp_path / "layer"  # as a shared image layer would be
    layer.mkdir()
    layer.chmod(0o777)  # writable by whatever host id sandbox root maps to
    (tmp_path / "mnt" / "root").mkdir(parents=True)
    fd = steps.PROC_FD + "/" + str(steps.PATH_FD_BASE)
    root = f"{steps.PROC_FD}/{steps.PATH_FD_BASE + 1}/root"
    plan = [
        steps.path_fd(os.fspath(layer), 0),
        steps.path_fd(os.fspath(tmp_path / "mnt"), 1),
        steps.become_root(),
        steps.mount("tmpfs", root, "tmpfs", (), "mode=755,size=1m", "mount the root"),
        steps.mkdir(f"{root}/proc", 0o555),
        steps.mount("proc", f"{root}/proc", "proc", ("MS_NOSUID", "MS_NODEV", "MS_NOEXEC"), None, "mount /proc"),
        steps.pivot(root),
        steps.mkdir("/inside", 0o755),  # the steps after the pivot still run
        steps.mkdir(f"{fd}/escaped", 0o755),
    ]
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    try:
        sock = zygote.request_spawn(
            clone_flags=zygote.CLONE_NEWUSER | zygote.CLONE_NEWNS | zygote.CLONE_NEWPID, steps=plan,
            idmaps=idmap.detect().how_to_write(), error_fd=err_w, sync_fd=go_r, keep_fds=[], exec_fd=-1,
            argv=["/nothing-to-run"], envp=[], keep_stdio=False, new_session=False, go_fd=go_w)
    finally:
        os.close(err_w)
        os.close(go_r)
        os.close(go_w)
    with sock:
        pid, pidfd = zygote.read_spawn_reply(sock)
        os.close(pidfd)
    with os.fdopen(err_r, "rb") as f:
        report = f.read()
    os.waitpid(pid, 0)
    assert not (layer / "escaped").exists(), "a step after the pivot created a directory on the host"
    assert len(report) >= 8, report
    step, err = struct.unpack("=ii", report[:8])
    assert (step, err) == (len(plan) - 1, errno.ENOENT), (step, os.strerror(err))
