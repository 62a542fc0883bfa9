"""Managing sandboxes from the command line, run as a person would: run
--detach, ps, exec, rm, gc and shell (on a real pseudo-terminal), and the
Inspect provider's connection() command, run as a person would paste it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path
from typing import Iterator

import anyio
import pytest
from inspect_ai.util import SandboxUserUnsupportedError

from nsbox import Sandbox, manage
from nsbox.create import zygote
from nsbox.host import live, removal
from nsbox.inspect.provider import NsboxSandboxEnvironment

NSBOX = [sys.executable, "-m", "nsbox"]


def nsbox(*args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NSBOX, *args], input=input, capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, seconds: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def ps_rows() -> dict[str, dict[str, str]]:
    r = nsbox("ps")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:5] == ["ID", "STATE", "OWNER", "AGE", "EXECS"], r.stdout
    rows = {}
    for line in lines[1:]:
        cells = line.split()
        rows[cells[0]] = dict(zip(["id", "state", "owner", "age", "execs", "rootfs"], cells))
    return rows


def assert_removed(info: live.SandboxInfo) -> None:
    """Nothing is left of the sandbox: entry, init, layer, runtime dir."""
    # Closed in this process: ended (the provider's sample_cleanup does not
    # wait for that) and released on its sweeper's thread.
    assert removal.wait_swept(10)
    assert live.read(info.id) is None
    assert not live.sandbox_dir(info.id).exists()
    assert wait_for(lambda: not info.init_alive), f"init {info.init_pid} still runs"
    assert not Path(info.layer).exists(), info.layer
    assert info.id not in ps_rows()


@contextlib.contextmanager
def detached(*command: str) -> Iterator[live.SandboxInfo]:
    """`nsbox run --detach -- COMMAND`; removed afterwards whatever happens."""
    r = nsbox("run", "--detach", "--", *command)
    assert r.returncode == 0, r.stderr
    sandbox_id = r.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{12}", sandbox_id), r.stdout
    assert f"nsbox rm {sandbox_id}" in r.stderr
    info = live.read(sandbox_id)
    assert info is not None
    try:
        yield info
    finally:
        if live.read(sandbox_id) is not None:
            manage.remove(info, force=True)


# ---- run --detach, ps, exec, rm --------------------------------------------


def test_detach_ps_exec_rm() -> None:
    with detached("sleep", "1000") as info:
        assert info.detached and info.origin == "cli" and info.init_alive
        assert Path(info.layer).is_dir()
        row = ps_rows()[info.id]
        assert row["state"] == "detached" and row["owner"] == "-", row
        assert int(row["execs"]) >= 1, row  # the sleep

        r = nsbox("exec", info.id, "--", "sh", "-c", "echo hi")
        assert (r.returncode, r.stdout, r.stderr) == (0, "hi\n", "")
        r = nsbox("exec", info.id, "--", "sh", "-c", "echo oops >&2; exit 7")
        assert (r.returncode, r.stdout, r.stderr) == (7, "", "oops\n")
        # A prefix of the id is enough, and the detached command still runs.
        r = nsbox("exec", info.id[:6], "--", "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
        assert r.returncode == 0 and "sleep 1000" in r.stdout, r
        assert int(ps_rows()[info.id]["execs"]) >= 4

        r = nsbox("rm", info.id)
        assert (r.returncode, r.stdout.strip()) == (0, info.id), r.stderr
        assert_removed(info)


def test_rm_of_a_missing_sandbox() -> None:
    r = nsbox("rm", "0123456789ab")
    assert r.returncode == 1
    assert r.stderr.startswith("nsbox: no sandbox '0123456789ab'"), r.stderr
    assert "nsbox ps" in r.stderr and "Traceback" not in r.stderr
    r = nsbox("exec", "0123456789ab", "--", "true")
    assert r.returncode == 1 and "no sandbox" in r.stderr and "Traceback" not in r.stderr


# ---- sandboxes owned by another process: rm --force, gc ---------------------

OWNER = textwrap.dedent("""
    import anyio, json, nsbox
    from nsbox.create import zygote
    async def main():
        sb = await nsbox.Sandbox.create()
        await sb.exec(["sh", "-c", "sleep 1000 & echo started"])
        print(json.dumps({"id": sb.id, "zygote": zygote.zygote_pid()}), flush=True)
        await anyio.sleep(1000)
    anyio.run(main)
""")


@contextlib.contextmanager
def owner_process() -> Iterator[tuple[subprocess.Popen[str], live.SandboxInfo, int]]:
    """A Python process that holds a sandbox open: (process, entry, pidfd of
    its nsbox-create zygote)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    pidfd = -1
    info = None
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line, "the owner process failed"
        data = json.loads(line)
        pidfd = os.pidfd_open(data["zygote"])
        info = live.read(data["id"])
        assert info is not None and info.owner_pid == owner.pid
        yield owner, info, pidfd
    finally:
        owner.kill()
        owner.wait()
        if info is not None and live.read(info.id) is not None:
            manage.remove(info, force=True)
        if pidfd >= 0:
            # The owner's zygote goes with it.
            assert select.select([pidfd], [], [], 5)[0], "the owner's zygote outlived it"
            os.close(pidfd)


def test_rm_refuses_a_sandbox_a_live_process_owns() -> None:
    with owner_process() as (owner, info, _):
        row = ps_rows()[info.id]
        assert row["state"] == "running" and row["owner"] == str(owner.pid), row
        r = nsbox("rm", info.id)
        assert r.returncode == 1 and r.stdout == ""
        assert f"sandbox {info.id} belongs to the running process {owner.pid}" in r.stderr, r.stderr
        assert "--force" in r.stderr and "Traceback" not in r.stderr
        assert info.init_alive and live.read(info.id) is not None and Path(info.layer).is_dir()
        assert owner.poll() is None

        r = nsbox("rm", "--force", info.id)
        assert (r.returncode, r.stdout.strip()) == (0, info.id), r.stderr
        assert_removed(info)
        assert owner.poll() is None  # the owner itself is left alone


def test_gc_removes_what_a_killed_owner_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A state directory of its own: another process of this user starting
    # its first sandbox would collect the dead one before `nsbox gc` does.
    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "state"))
    with owner_process() as (owner, info, zygote):
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        # The init dies with its lifeline; the entry and layer stay behind.
        assert wait_for(lambda: not info.init_alive)
        assert ps_rows()[info.id]["state"] == "dead"
        assert live.read(info.id) is not None and Path(info.layer).is_dir()

        r = nsbox("gc", "-n")
        assert r.returncode == 0, r.stderr
        assert f"would remove sandbox {info.id}" in r.stdout.splitlines(), r.stdout
        assert "removed" not in r.stdout
        assert live.read(info.id) is not None and Path(info.layer).is_dir()  # only reported

        r = nsbox("gc")
        assert r.returncode == 0, r.stderr
        assert f"removed sandbox {info.id}" in r.stdout.splitlines(), r.stdout
        assert_removed(info)
        r = nsbox("gc", "-n")
        assert info.id not in r.stdout


async def test_gc_keeps_the_layer_of_a_sandbox_another_shell_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live list is under the runtime directory, which another shell's
    XDG_RUNTIME_DIR may put elsewhere: gc from there took a running
    sandbox's writable layer, a minute old, for an orphan."""
    async with Sandbox() as sb:
        assert sb._layer is not None
        with monkeypatch.context() as m:
            m.setattr(live, "entries", lambda: [])  # another shell's list
            m.setattr(manage, "ORPHAN_LAYER_AGE", 0.0)
            assert sb._layer not in manage.garbage()[1]
            assert sb.id in manage.running_inits()
        assert (await sb.exec(["true"])).success


VOLUMES_MAKER = """\
import sys
from nsbox import manage
root = manage.volume_base() / sys.argv[1]
root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
manage.record_volume_users(root, [])  # as a compose sample makes its volumes
(root / "data").mkdir(parents=True)
(root / "data" / "f").write_bytes(bytes(1 << 20))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.once  # the host's collection (one sandbox only lends it a live init)
def test_a_killed_samples_volumes_are_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compose sample's named volumes, left by a process killed while it
    started the sample or ran it, are garbage for `nsbox gc` and for the
    next start's collection, as are those whose sandboxes are all gone;
    those of a live process starting its sample are not."""
    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "state"))
    makers = {}
    for name in ("killed-1", "killed-2", "alive"):
        makers[name] = subprocess.Popen([sys.executable, "-c", VOLUMES_MAKER, name], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
    try:
        for p in makers.values():
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for name in ("killed-1", "killed-2"):
            makers[name].kill()
            makers[name].wait()
        base = manage.volume_base()
        # Parts of records (dirs.write_whole): one a killed writer left, one being written.
        stale, writing = base / "killed-0.sandboxes.tmp", base / "writing.sandboxes.tmp"
        for part in (stale, writing):
            part.write_text('{"owner"')
        os.utime(stale, (time.time() - 120,) * 2)
        assert sorted(manage.orphan_volumes()) == [base / "killed-1", base / "killed-2"]
        r = nsbox("gc", "-n")
        assert f"would remove volumes {base / 'killed-1'}" in r.stdout.splitlines(), r.stdout
        assert (base / "killed-1" / "data" / "f").is_file() and stale.exists()
        r = nsbox("gc")
        assert r.returncode == 0, r.stderr
        assert f"removed volumes {base / 'killed-1'}" in r.stdout.splitlines(), r.stdout
        assert sorted(p.name for p in base.iterdir()) == ["alive", "alive.sandboxes", writing.name]
        os.utime(writing, (time.time() - 120,) * 2)

        async def started() -> None:
            """A sample's recorded sandboxes keep its volumes, by their inits,
            whatever runtime directory (another shell's) the collector reads;
            once they are gone, its maker alive or not, no one does."""
            async with Sandbox() as sb:
                manage.record_volume_users(base / "started", [sb.id])
                (base / "started").mkdir()
                with monkeypatch.context() as m:
                    m.setattr(live, "read", lambda _: None)
                    assert base / "started" not in manage.orphan_volumes()

        anyio.run(started)
        assert manage.orphan_volumes() == [base / "started"]
        # The collection a process's first sandbox starts does the same.
        makers["alive"].kill()
        makers["alive"].wait()
        manage.collect_dead()
        assert list(base.iterdir()) == []
    finally:
        for p in makers.values():
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- nsbox shell on a real terminal ----------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


class Terminal:
    """A process on a new pseudo-terminal (its controlling terminal), typed
    into and read from like a person at a terminal would."""

    def __init__(self, args: list[str], rows: int, cols: int) -> None:
        self.master, slave = os.openpty()
        self.set_size(rows, cols)
        env = {**os.environ, "TERM": "xterm"}
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.output = ""
        self.pos = 0  # what expect() has consumed

    def set_size(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def _read(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            data = b""
        self.output += ANSI.sub("", data.decode(errors="replace"))
        return bool(data)

    def expect(self, pattern: str, timeout: float = 15) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.output, self.pos)
            if m:
                self.pos = m.end()
                return m
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)) and self.proc.poll() is not None:
                raise AssertionError(f"{pattern!r} not seen; the terminal shows:\n{self.output[self.pos:]}")

    def run(self, command: str, pattern: str) -> re.Match[str]:
        """Types `command` and waits for `pattern` in what follows its echo."""
        self.type(command + "\n")
        self.expect(re.escape(command) + "\n")
        return self.expect(pattern)

    def wait(self, timeout: float = 15) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        # What was printed last: read until nothing more is ready (or
        # the slave side is gone, which reads as an end).
        while select.select([self.master], [], [], 0)[0] and self._read(0):
            pass
        if self.proc.poll() is None:
            raise AssertionError(f"still running after {timeout}s; the terminal shows:\n{self.output[self.pos:]}")
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


@contextlib.contextmanager
def terminal(args: list[str], rows: int = 24, cols: int = 80) -> Iterator[Terminal]:
    t = Terminal(args, rows, cols)
    try:
        # Wait for the prompt: nsbox puts the terminal in raw mode with
        # TCSAFLUSH (tty.setraw), which discards what was typed before.
        t.expect(r"[#$] $")
        yield t
    finally:
        t.close()


WAIT_FOR_RESIZE = """\
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})
print("waiting", flush=True)
if signal.sigtimedwait({signal.SIGWINCH}, 20) is None:
    print("no SIGWINCH in 20s")
size = os.get_terminal_size(0)
print(f"resized to {size.columns}x{size.lines}")
"""


def test_shell_in_a_fresh_sandbox() -> None:
    with terminal([*NSBOX, "shell"], rows=33, cols=101) as t:
        t.run("echo $((6*7))", r"\b42\b")
        sandbox_id = t.run("echo host=$(hostname)", r"host=([0-9a-f]{12})\b").group(1)
        info = live.read(sandbox_id)
        assert info is not None and info.origin == "cli" and not info.detached

        # The window size, at start and after changes: one that a program
        # waits for (passed on when the SIGWINCH comes, nothing typed), one
        # followed at once by a command (which must see the new size).
        t.run("stty size", r"\b33 101\b")
        r = nsbox("exec", sandbox_id, "--", "sh", "-c", "cat > /tmp/winch.py", input=WAIT_FOR_RESIZE)
        assert r.returncode == 0, r.stderr
        t.run("python3 /tmp/winch.py", r"waiting")
        t.set_size(40, 120)
        t.proc.send_signal(signal.SIGWINCH)
        t.expect(r"resized to 120x40\b")
        t.set_size(45, 130)
        t.run("stty size", r"\b45 130\b")

        # Job control: a background job, a stopped one, an interrupted one.
        t.run("sleep 100 &", r"\[1\] \d+")
        t.run("jobs", r"\[1\]\+\s+Running\s+sleep 100 &")
        t.run("sleep 200", r"")
        time.sleep(0.5)
        t.type("\x1a")  # ^Z
        t.expect(r"\[2\]\+\s+Stopped\s+sleep 200")
        t.run("jobs", r"\[1\]-\s+Running\s+sleep 100 &\n\[2\]\+\s+Stopped\s+sleep 200")
        t.run("sleep 300", r"")
        time.sleep(0.5)
        started = time.monotonic()
        t.type("\x03")  # ^C
        t.run("echo after-$((1+1))", r"after-2")
        assert time.monotonic() - started < 5
        assert "no job control" not in t.output
        # bash learns of the stopped job's death from a SIGCHLD that may come
        # after `wait` returns; `exit` would then refuse ("There are stopped
        # jobs."). Asking `jobs` until the job is gone makes it take note.
        t.run("kill -9 %1 %2; wait; while jobs %2 >/dev/null 2>&1; do sleep 0.05; done; echo killed-$((2+2))",
              r"killed-4")

        t.type("exit 3\n")
        assert t.wait() == 3
    # A fresh sandbox goes with its shell.
    assert_removed(info)


def test_shell_into_a_detached_sandbox() -> None:
    with detached("sleep", "1000") as info:
        with terminal([*NSBOX, "shell", info.id], rows=20, cols=70) as t:
            t.run("echo $((6*7)) $(hostname) $(id -u)", rf"\b42 {info.id} 0\b")
            t.run("stty size", r"\b20 70\b")
            t.run("echo touched > /tmp/from-shell", r"")
            t.type("exit 5\n")
            assert t.wait() == 5
        # Leaving the shell leaves the sandbox running.
        assert ps_rows()[info.id]["state"] == "detached"
        r = nsbox("exec", info.id, "--", "cat", "/tmp/from-shell")
        assert (r.returncode, r.stdout) == (0, "touched\n"), r.stderr
        assert nsbox("rm", info.id).returncode == 0
        assert_removed(info)


def test_shell_into_a_sandbox_whose_ptmx_was_replaced() -> None:
    """/dev/ptmx is sandbox root's to replace: a FIFO there had ended
    `nsbox shell` in a traceback; a file could have held its ioctls."""
    with detached("sleep", "1000") as info:
        for replace in ("mkfifo /dev/ptmx", "echo x > /dev/ptmx", "ln -s /dev/null /dev/ptmx"):
            r = nsbox("exec", info.id, "--", "sh", "-c", f"rm -f /dev/ptmx && {replace}")
            assert r.returncode == 0, r.stderr
            r = nsbox("shell", info.id, timeout=30)
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
            assert r.stderr.startswith(f"nsbox: cannot open a pseudo-terminal in sandbox {info.id}: /dev/ptmx"), r.stderr
        assert nsbox("rm", info.id).returncode == 0


# ---- the Inspect provider's connection() ------------------------------------


@pytest.fixture
async def inspect_env() -> Iterator[NsboxSandboxEnvironment]:  # type: ignore[misc]
    envs = await NsboxSandboxEnvironment.sample_init("conn", None, {"__sample_id__": "1"})
    env = envs["default"]
    assert isinstance(env, NsboxSandboxEnvironment)
    try:
        yield env
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("conn", None, envs, False)


async def test_connection_logs_in_as_the_default_user(inspect_env: NsboxSandboxEnvironment) -> None:
    sb = inspect_env.sandbox
    conn = await inspect_env.connection()
    assert conn.type == "nsbox" and conn.container == sb.id
    # Pasted into a terminal, as a person would.
    with terminal(["/bin/sh", "-c", conn.command], cols=200) as t:
        probe = "echo $(id -u) $(pwd) $(hostname) $(cat /proc/1/comm) $(readlink /proc/self/ns/user)"
        found = t.run(probe, r"(\d+) (\S+) (\S+) (\S+) (user:\S+)").groups()
        # The session lives in the user namespace sandbox processes run in
        # (the nested one the init holds as a descriptor), on a terminal of
        # the sandbox's own.
        nested = os.readlink(f"/proc/{sb.pid}/fd/{zygote.lib.NSBOX_FD_USERNS}")
        assert found == ("0", sb.workdir, sb.hostname, "nsbox-init", nested)
        t.run("tty", r"/dev/pts/\d+")
        t.type("exit 4\n")
        assert t.wait() == 4


async def test_connection_as_another_user(inspect_env: NsboxSandboxEnvironment, mode: str) -> None:
    if mode == "single":
        # Only one uid is mapped: saying so at once beats a command that fails.
        with pytest.raises(SandboxUserUnsupportedError, match="maps only your own uid"):
            await inspect_env.connection(user="nobody")
        return
    conn = await inspect_env.connection(user="nobody")
    with terminal(["/bin/sh", "-c", conn.command]) as t:
        t.run("id -u", r"\b65534\b")
        t.type("exit\n")
        assert t.wait() == 0


async def test_connection_after_cleanup() -> None:
    envs = await NsboxSandboxEnvironment.sample_init("conn", None, {})
    env = envs["default"]
    assert isinstance(env, NsboxSandboxEnvironment)
    info = live.read(env.sandbox.id)
    assert info is not None
    await NsboxSandboxEnvironment.sample_cleanup("conn", None, envs, False)
    with pytest.raises(ConnectionError, match="not running"):
        await env.connection()
    assert_removed(info)


# ---- what a killed eval leaves is collected by the next start -----------------

KILLED_TASK = """\
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.solver import solver
from inspect_ai.util import sandbox


@solver
def wait():
    async def solve(state, generate):
        await sandbox().exec(["sleep", "300"])
        return state
    return solve


@task
def killed():
    return Task(dataset=[Sample(input="a", id=1), Sample(input="b", id=2)], solver=wait(), sandbox="nsbox")
"""

NEXT_START = """\
import anyio, nsbox
from nsbox import manage

async def main():
    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["true"])).success
    assert manage.wait_collected(60), "still collecting after 60s"

anyio.run(main)
"""


@pytest.mark.timeout(180)
def test_a_killed_evals_sandboxes_are_collected_by_the_next_start(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A state directory of its own: no other process of this user (another
    # test run's `nsbox gc`) collects them first.
    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "task.py").write_text(KILLED_TASK)
    inspect = Path(sys.executable).with_name("inspect")
    ev = subprocess.Popen(["timeout", "-s", "TERM", "120", str(inspect), "eval", "task.py", "--model", "mockllm/model",
                           "--max-samples", "2", "--log-dir", str(tmp_path / "logs"), "--display", "none"],
                          cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def theirs() -> list[live.SandboxInfo]:
            return [i for i in live.entries() if i.label.startswith("killed sample")
                    and _descends(i.owner_pid, ev.pid) and i.init_alive]

        assert wait_for(lambda: len(theirs()) == 2, 60), "the eval did not start both samples"
        infos = theirs()
        for pid in {i.owner_pid for i in infos}:  # `inspect eval`, as `timeout` ends it
            os.kill(pid, signal.SIGTERM)
        ev.wait(30)
    finally:
        if ev.poll() is None:
            ev.kill()
            ev.wait()
    # Left behind: dead, with their layers on disk.
    assert wait_for(lambda: not any(i.init_alive for i in infos), 10)
    rows = ps_rows()
    assert all(rows[i.id]["state"] == "dead" for i in infos), rows
    assert all(Path(i.layer).is_dir() for i in infos)
    # The next start of nsbox by this user collects them, not touching others.
    with owner_process() as (owner, alive, _):
        r = subprocess.run([sys.executable, "-c", NEXT_START], capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        for info in infos:
            assert live.read(info.id) is None
            assert not Path(info.layer).exists(), info.layer
            assert info.id not in ps_rows()
        assert alive.init_alive and live.read(alive.id) is not None and Path(alive.layer).is_dir()
        assert owner.poll() is None


def _descends(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or one of its descendants."""
    import psutil

    try:
        return pid == ancestor or any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False
