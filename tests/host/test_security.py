"""Attacks from inside a sandbox that an adversarial review found to work,
each performed here for real (the fifth, a 3000-deep tree that broke
cleanup, is in test_removal.py).

1. A planted /bin/sh run by the operator's connection command, with the
   operator's terminal, typing into it with TIOCSTI.
2. write_file into a FIFO whose reader never reads, blocking the host.
3. SIGSTOP of nsbox's helpers (the init's children before they exec),
   hanging file operations and execs forever.
4. As real root: reading files only host root may read, and host
   setuid-root binaries.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

import nsbox
from nsbox.create import zygote
from nsbox.host import live
from nsbox.inspect.provider import NsboxSandboxEnvironment
from nsbox.spec import Bind

from tests import components
from .test_manage import Terminal

pytestmark = pytest.mark.timeout(120)

# ---- 1. the connection command --------------------------------------------

PLANTED = """#!/usr/bin/python3
import fcntl, os, termios
try:
    for c in "touch {marker}\\n":
        fcntl.ioctl(0, termios.TIOCSTI, c.encode())
    sti = "typed"
except OSError as e:
    sti = "refused-%d" % e.errno
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
with open("/tmp/planted-ran", "w") as f:
    f.write("%s %s %s" % (os.readlink("/proc/self/ns/user"), caps, sti))
"""


async def test_connection_never_runs_planted_code_on_the_operators_terminal(tmp_path: Path) -> None:
    envs = await NsboxSandboxEnvironment.sample_init("attack", None, {})
    env = envs["default"]
    assert isinstance(env, NsboxSandboxEnvironment)
    sb = env.sandbox
    marker = tmp_path / "PWNED"
    os.chmod(tmp_path, 0o777)  # so that a planted command, were it to run on the host, could create it
    try:
        # Sandbox root replaces /bin (a writable symlink on the host root)
        # by a directory of programs that type into their terminal.
        r = await sb.exec(["sh", "-c", "rm /bin && mkdir /bin"])
        assert r.success, r.stderr
        for name in ("sh", "bash"):
            await sb.write_file(f"/bin/{name}", PLANTED.format(marker=marker))
            assert (await sb.exec(["/usr/bin/chmod", "755", f"/bin/{name}"])).success
        reference = await sb.exec(["/usr/bin/python3", "-c", (
            "import os; caps=[l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0];"
            "print(os.readlink('/proc/self/ns/user'), caps)")])
        conn = await env.connection()

        # The operator pastes it into their own interactive shell.
        operator = Terminal(["/bin/bash", "--norc", "--noprofile", "-i"], 24, 200)
        try:
            operator.expect(r"[#$] $")
            operator.type(f"{conn.command}; echo session-over-$((1+1))\n")
            operator.expect(r"session-over-2")
            time.sleep(1.0)  # anything typed into the operator's terminal runs now
            operator.type("exit\n")
            operator.wait()
        finally:
            operator.close()

        assert not marker.exists(), "a sandbox program typed a command into the operator's shell"
        # The planted shell did run (as the login shell), but as sandbox
        # root where every sandbox process runs, not in the init's user
        # namespace with more capabilities.
        ran = (await sb.read_file("/tmp/planted-ran")).split()
        assert ran[:2] == reference.stdout.split(), (ran, reference.stdout)
        nested = os.readlink(f"/proc/{sb.pid}/fd/{zygote.lib.NSBOX_FD_USERNS}")
        assert ran[0] == nested
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("attack", None, envs, False)


# ---- 2. write_file into a FIFO -------------------------------------------

STALL_FIFO = r"""
import fcntl, os, time
os.mkfifo("/tmp/fifo")
fd = os.open("/tmp/fifo", os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
fcntl.fcntl(fd, 1031, 4096)  # F_SETPIPE_SZ: the smallest pipe
os.symlink("/tmp/fifo", "/tmp/link-to-fifo")
open("/tmp/ready", "w").close()
time.sleep(600)
"""


async def test_write_file_refuses_a_fifo_without_blocking(sandbox: nsbox.Sandbox) -> None:
    await sandbox.spawn(["python3", "-c", STALL_FIFO])
    with anyio.fail_after(10):
        while not (await sandbox.exec(["test", "-e", "/tmp/ready"])).success:
            await anyio.sleep(0.05)

    # A blocked host would hang here (the write ran on the event loop, so
    # fail_after could not even fire): pytest-timeout would fail the test.
    for path in ("/tmp/fifo", "/tmp/link-to-fifo", "/dev/null"):
        for payload in (b"x" * 4096, b"x" * (4 << 20)):
            started = time.monotonic()
            with anyio.fail_after(10), pytest.raises(OSError, match="Not a regular file"):
                await sandbox.write_file(path, payload)
            assert time.monotonic() - started < 5
        with anyio.fail_after(10), pytest.raises(OSError, match="Not a regular file"):
            await sandbox.read_file(path)
    await sandbox.write_file("/tmp/regular", b"fine")
    assert await sandbox.read_file("/tmp/regular", text=False) == b"fine"


# ---- 3. stopping nsbox's helpers ----------------------------------------

STOP_HELPERS = r"""
import os, signal
# Every nsbox-init but PID 1 is a helper of the init (not yet a command):
# stop each one as soon as it appears.
while True:
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != "1":
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != "nsbox-init":
                        continue
                os.kill(int(pid), signal.SIGSTOP)
                # It may have become a command meanwhile: stopping those is
                # every sandbox process's right, and not what is tested.
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != "nsbox-init":
                        os.kill(int(pid), signal.SIGCONT)
            except OSError:
                pass
"""


@pytest.mark.once  # the init once set up: its helpers take the command's ids in every mode
@pytest.mark.timeout(150)
async def test_stopped_helpers_are_noticed_not_waited_for(sandbox: nsbox.Sandbox) -> None:
    sb = sandbox
    await sb.write_file("/tmp/f", "content")
    await sb.spawn(["python3", "-c", STOP_HELPERS])
    outcomes = {"ok": 0, "helper": 0, "command stopped": 0}
    # No call may wait on a stopped helper: each ends by itself, soon. The
    # attacker races with exec, though: it can stop a command in the middle
    # of its execve, after which it is no longer nsbox's helper but the
    # command, which is the sandbox's to stop; the exec's own timeout ends
    # that wait. File operations have no command: they must never time out.
    with anyio.fail_after(100):
        for _ in range(15):
            for op in (lambda: sb.read_file("/tmp/f"), lambda: sb.write_file("/tmp/g", "x"),
                       lambda: sb.exec(["true"], timeout=1), lambda: sb.exec(["id", "-u"], user="root", timeout=1)):
                try:
                    await op()
                    outcomes["ok"] += 1
                except nsbox.CommandTimeout:
                    outcomes["command stopped"] += 1
                except (nsbox.NsboxError, OSError) as e:
                    assert "helper" in str(e), e
                    outcomes["helper"] += 1
    # The attacker did stop helpers, and each time nsbox said so.
    assert outcomes["helper"] > 0, outcomes


# A PATH whose search keeps a command's helper busy for a few milliseconds
# before its execve: long enough for an attacker to catch it.
LONG_PATH = ":".join(f"/no/such/dir/{i:05d}" for i in range(2800)) + ":/usr/bin:/bin"


@pytest.mark.timeout(150)
async def test_a_stopped_exec_helper_never_stops_pid1(sandbox: nsbox.Sandbox) -> None:
    # Until its execve, a command's helper shares the init's memory and the
    # init waits for it. A long PATH to search keeps the helper busy for a
    # few milliseconds, long enough for the attacker to stop it: the init
    # must notice, kill it and say so, and go on serving.
    sb = sandbox
    await sb.spawn(["python3", "-c", STOP_HELPERS])
    stopped = 0
    with anyio.fail_after(120):
        for _ in range(60):
            started = time.monotonic()
            try:
                r = await sb.exec(["true"], env={"PATH": LONG_PATH}, timeout=2)
                assert r.success, r
            except nsbox.CommandTimeout:
                # Stopped during its execve: by then the command, the
                # sandbox's to stop; its own timeout ends the wait.
                pass
            except (nsbox.NsboxError, OSError) as e:
                assert "helper" in str(e), e
                stopped += 1
            # A stopped helper is noticed within milliseconds; only a stopped
            # command takes its 2 s timeout (and the kill after it).
            assert time.monotonic() - started < 4.5
            if stopped >= 3:
                break
        assert stopped > 0, "the attacker never caught a helper: the test proves nothing"
        # PID 1 was never stopped: it answers at once.
        status = await sb.client.status()
    assert status["execs"] > 0


@pytest.mark.timeout(150)
async def test_a_killed_exec_helper_is_reported_not_taken_for_the_command(sandbox: nsbox.Sandbox) -> None:
    # A helper a sandbox process kills before its execve never ran the
    # command: the caller must hear that, not an exit status of 137 from a
    # command that never started.
    sb = sandbox
    await sb.spawn(["python3", "-c", STOP_HELPERS.replace("signal.SIGSTOP", "signal.SIGKILL")])
    outcomes = {"ok": 0, "helper": 0, "killed": 0}
    with anyio.fail_after(120):
        for _ in range(40):
            try:
                r = await sb.exec(["true"], env={"PATH": LONG_PATH}, timeout=5)
                outcomes["ok" if r.success else "killed"] += 1
                assert r.success or r.returncode == 137, r
            except (nsbox.NsboxError, OSError) as e:
                assert "killed nsbox's helper" in str(e), e
                outcomes["helper"] += 1
    # A kill that lands during the execve that starts the command reads as
    # the command's; one before it must not. The PATH search looks before
    # it calls execve, so nearly every kill lands before: 0 of 180 read as
    # the command's in three runs here. When each directory was tried with
    # execve, 25 to 57 of 60 did. On a loaded machine (CI beside other
    # work) up to a fifth of the kills have landed in the execve.
    assert outcomes["helper"] > 0 and outcomes["killed"] * 2 <= outcomes["helper"], outcomes


FUSE_HOLD = Path(__file__).resolve().parents[1] / "fuse_hold.c"


@pytest.mark.once  # the init's wait for its helper (11 s): the same code in every mode
@pytest.mark.timeout(120)
async def test_a_helper_stuck_in_the_kernel_does_not_stall_pid1(tmp_path: Path) -> None:
    # A helper that shares the init's memory can get stuck where SIGKILL
    # does not reach it: here on a FUSE file system, served by a sandbox
    # process that never answers (a hung NFS server does the same). The init
    # must stop waiting, say why, keep serving, and still die with its
    # lifeline.
    components.require("fuse")  # most distributions make it mode 0666; .ci/run does
    hold = tmp_path / "fuse_hold"
    subprocess.run([shutil.which("cc") or "gcc", "-O2", "-static", "-o", str(hold), str(FUSE_HOLD)], check=True,
                   timeout=60)
    hold.parent.chmod(0o755)
    binds = (Bind("/dev/fuse", "/dev/fuse"), Bind(str(tmp_path), "/opt/hold", readonly=True))
    sb = await nsbox.Sandbox.create(nested_userns=True, mounts=binds)
    init = sb.pid
    try:
        # With fs.suid_dumpable 0 (the kernel's default), commands start in a
        # child sharing the init's memory; this test is about that child.
        with open("/proc/sys/fs/suid_dumpable") as f:
            assert (await sb.status())["shared_spawn"] == (f.read().strip() == "0")
        await sb.exec(["mkdir", "/tmp/hung"])
        await sb.spawn(["sh", "-c", "exec /opt/hold/fuse_hold /tmp/hung 100 >/tmp/hold.log 2>&1"])
        with anyio.fail_after(20):
            log = ""
            while "mounted" not in log:
                assert "mount" not in log, log  # it failed: the message says why
                await anyio.sleep(0.05)
                r = await sb.exec(["cat", "/tmp/hold.log"])  # not there until the shell opened it
                log = r.stdout + r.stderr
        with anyio.fail_after(40):  # the init gives up on it after 11 s
            with pytest.raises(nsbox.NsboxError, match="stuck"):
                await sb.exec(["true"], cwd="/tmp/hung", timeout=90)
            # It is still there, in the kernel, and the init serves on.
            import psutil
            stuck = [p for p in psutil.Process(init).children() if p.status() == psutil.STATUS_DISK_SLEEP]
            assert stuck, [(p.pid, p.status()) for p in psutil.Process(init).children()]
            assert (await sb.exec(["echo", "serving"])).stdout == "serving\n"
            assert "holding opcode" in await sb.read_file("/tmp/hold.log")
    finally:
        with anyio.fail_after(20):
            await sb.close()
    # The lifeline still works: the init and everything of the sandbox,
    # the helper once its file system is gone, have exited.
    with anyio.fail_after(10):
        while live.process_start_time(init) is not None:  # None: gone, or a zombie
            await anyio.sleep(0.05)


@pytest.mark.timeout(150)
async def test_a_fuse_file_stalls_no_one(tmp_path: Path) -> None:
    """A file on a FUSE file system a sandbox process serves and never
    answers reads of: read_file refuses it at once. It had held the host's
    close of the file (FUSE's flush), and so its whole event loop, until the
    server chose to exit."""
    components.require("fuse")
    hold = tmp_path / "fuse_hold"
    subprocess.run([shutil.which("cc") or "gcc", "-O2", "-static", "-o", str(hold), str(FUSE_HOLD)], check=True,
                   timeout=60)
    hold.parent.chmod(0o755)
    binds = (Bind("/dev/fuse", "/dev/fuse"), Bind(str(tmp_path), "/opt/hold", readonly=True))
    async with nsbox.Sandbox(nested_userns=True, mounts=binds) as sb:
        await sb.exec(["mkdir", "/tmp/held"])
        await sb.spawn(["sh", "-c", "exec /opt/hold/fuse_hold /tmp/held 100 file >/tmp/hold.log 2>&1"])
        with anyio.fail_after(20):
            while "mounted" not in (await sb.exec(["cat", "/tmp/hold.log"])).stdout:
                await anyio.sleep(0.05)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(0.05)
                ticks += 1

        start = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            # (write_file takes the same check; its open here would wait on
            # the server, held to the open's own bound, off the event loop.)
            with pytest.raises(PermissionError, match="FUSE") as e:
                await sb.read_file("/tmp/held/flag")
            assert e.value.filename == "/tmp/held/flag"
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
        assert time.monotonic() - start < 20 and ticks >= 5, "the event loop stood still"


# ---- 4. real root's sandboxes --------------------------------------------


def _root_only_host_files() -> list[str]:
    found = []
    for path in ("/etc/security/opasswd", "/etc/ssl/private", "/etc/sudoers", "/etc/ssh/ssh_host_ed25519_key",
                 "/root"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == 0 and not st.st_mode & 0o077:
            found.append(path)
    return found


async def test_root_only_host_files_stay_unreadable(mode: str) -> None:
    paths = [p for p in _root_only_host_files() if p != "/root"]
    assert paths, "no root-only file under /etc to test with"
    async with nsbox.Sandbox() as sb:
        for path in paths:
            r = await sb.exec(["sh", "-c", f"cat {path} && ls {path}/"])
            assert not r.success and "Permission denied" in r.stderr, (path, r)
            with pytest.raises(PermissionError):
                await sb.read_file(path)
        # The host's setuid binaries are inert: /usr is nosuid.
        mounts = (await sb.exec(["cat", "/proc/self/mountinfo"])).stdout.splitlines()
        usr = [line for line in mounts if line.split()[4] == "/usr"]
        assert usr and "nosuid" in usr[0].split()[5].split(","), usr
        if mode == "root":
            # Sandbox root is a subordinate id, not host root.
            uid_map = Path(f"/proc/{sb.pid}/uid_map").read_text().split()
            assert uid_map[0] == "0" and uid_map[1] != "0", uid_map
            assert sb.idmap is not None and "host root is not mapped" in sb.idmap.reason


async def test_root_setuid_binary_from_the_host_is_inert(tmp_path: Path, mode: str) -> None:
    if mode != "root":
        pytest.skip("only real root can make a root-owned setuid binary to test with "
                    "(in the other modes host root is never mapped)")
    tool = tmp_path / "suid-id"
    shutil.copy("/usr/bin/id", tool)
    os.chown(tool, 0, 0)
    os.chmod(tool, 0o4755)
    os.chmod(tmp_path, 0o755)
    async with nsbox.Sandbox(mounts=[Bind(str(tmp_path), "/tools", readonly=True)]) as sb:
        r = await sb.exec(["/tools/suid-id"], user="nobody")
        assert r.success and "euid=0" not in r.stdout and r.stdout.startswith("uid=65534"), r.stdout
    # The explicit opt-in maps host root, and with it the setuid bit.
    async with nsbox.Sandbox(mounts=[Bind(str(tmp_path), "/tools", readonly=True)], id_mapping="host-root") as sb:
        r = await sb.exec(["/tools/suid-id"], user="nobody")
        assert "euid=0" in r.stdout, r.stdout
    assert stat.S_IMODE(tool.stat().st_mode) == 0o4755


def test_host_root_mapping_is_refused_to_others(mode: str) -> None:
    if mode == "root":
        return  # root may ask for it (tested above)
    with pytest.raises(nsbox.NsboxError, match="only root"):
        anyio.run(functools.partial(nsbox.Sandbox.create, id_mapping="host-root"))


def test_cli_names_the_opt_in() -> None:
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--help"], capture_output=True, text=True, timeout=30)
    assert "host-root" in r.stdout
