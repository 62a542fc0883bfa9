"""Creating and destroying sandboxes: nothing may be left behind, whatever
the sandboxed processes try and however the owner ends."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import psutil
import pytest

import nsbox
from nsbox.host import dirs, live, removal
from nsbox.create import zygote
from nsbox.host import layers as layer_store

from tests.conftest import script_result


def pidns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def members(ns: str) -> list[int]:
    """Host pids of the processes in pid namespace `ns` (that we may inspect)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    found.append(int(name))
            except OSError:
                pass
    return found


def wait_until_empty(ns: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := members(ns)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# Processes that try to outlive the sandbox: a daemon (double fork, setsid),
# one that ignores SIGTERM and SIGHUP, and a plain background job.
ESCAPERS = ("(setsid sh -c 'trap \"\" TERM HUP; sleep 1000' </dev/null >/dev/null 2>&1 &) ;"
            " nohup sleep 1001 </dev/null >/dev/null 2>&1 &")


async def test_context_manager_and_explicit_lifecycle() -> None:
    async with nsbox.Sandbox() as sb:
        assert sb.running and (await sb.exec(["true"])).success
    assert not sb.running
    sb = await nsbox.Sandbox.create()
    try:
        assert (await sb.exec(["echo", "x"])).stdout == "x\n"
    finally:
        await sb.close()
    await sb.close()  # closing twice is fine
    with pytest.raises(RuntimeError):
        await sb.start()


def host_state() -> tuple[set[str], set[str], str]:
    """What sandboxes leave on the host once this process's closed ones are
    released (layers, on the sweeper's thread): layers but for the pool and
    the trash, live entries, this process's mounts."""
    assert removal.wait_swept(10)
    layers = set(os.listdir(layer_store.layers_dir())) - {layer_store.REUSE, layer_store.TRASH}
    return layers, set(os.listdir(dirs.runtime_dir())), Path("/proc/self/mountinfo").read_text()


def children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


async def before_a_loop() -> tuple[tuple[set[str], set[str], str], set[int]]:
    """host_state() and this process's children, once the zygote (and the
    holder), which outlive a loop of sandboxes, have started."""
    async with nsbox.Sandbox():
        pass
    return host_state(), children()


async def test_create_destroy_loop_leaves_nothing(mode: str) -> None:
    # Untouched layers may be kept for reuse (at most REUSE_MAX of them);
    # nothing else may remain.
    before, before_children = await before_a_loop()
    for i in range(15):
        sb = await nsbox.Sandbox.create()
        await sb.exec(["sh", "-c", ESCAPERS])
        if mode != "single" and i % 3 == 0:
            # Files of another sandbox user in the writable layer.
            await sb.exec(["sh", "-c", "mkdir -p /var/tmp/d/e && touch /var/tmp/d/e/f && "
                                       "chown -R nobody /var/tmp/d && chmod -R 700 /var/tmp/d"])
        ns = pidns(sb.pid)
        await sb.close()
        assert wait_until_empty(ns, 2) == [], f"processes left in round {i}"
    # The layers are released, and the overlays' work dirs swept from the
    # trash, on a thread.
    assert host_state() == before
    layers = layer_store.layers_dir()
    pool = layers / layer_store.REUSE
    assert not pool.exists() or len(os.listdir(pool)) <= layer_store.REUSE_MAX
    trash = layers / layer_store.TRASH
    assert not trash.exists() or os.listdir(trash) == []
    assert children() == before_children  # nothing unreaped


def process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("init", ["ends when told", "stopped"])
async def test_a_close_that_does_not_wait_ends_everything_on_the_sweeper(init: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """close(wait=False), the Inspect provider's sample_cleanup, returns
    once the init is told to end; the sweeper thread then waits for it
    (killing it after CLOSE_WAIT s if it has not ended: here one stopped
    from the host), and releases the rest. Nothing is left: no process of
    the sandbox, the daemons that try to outlive it included, no live
    entry, no layer but the pool's, no unreaped child."""
    monkeypatch.setattr(nsbox.sandbox, "CLOSE_WAIT", 0.3)  # (2 s) the stopped init's wait, shorter
    before, before_children = await before_a_loop()
    sb = await nsbox.Sandbox.create()
    await sb.exec(["sh", "-c", ESCAPERS])
    pid, ns = sb.pid, pidns(sb.pid)
    if init == "stopped":
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(pid) != "T" and time.monotonic() < deadline:
            await anyio.sleep(0.01)
    await sb.close(wait=False)
    assert not sb.running
    if init == "stopped":
        assert process_state(pid) == "T", "close(wait=False) waited for the init"
    assert removal.wait_swept(30), "the sweeper did not finish"
    assert process_state(pid) is None
    assert wait_until_empty(ns, 2) == []
    assert host_state() == before
    assert children() == before_children


async def test_a_cancelled_create_leaves_nothing() -> None:
    """Cancelled at every moment of its making (here: each few tenths of a
    millisecond), a sandbox without limits, whose process the zygote lets
    go on by itself, had been left running, found by nothing: no live entry,
    its layer mounted, until this process exited."""
    before, before_children = await before_a_loop()
    for i in range(40):
        with anyio.move_on_after(0.0002 * (i % 10)):
            sb = await nsbox.Sandbox.create()
            await sb.close()
    deadline = time.monotonic() + 10
    while children() != before_children and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    left = [(c.pid, c.name()) for c in psutil.Process().children(recursive=True) if c.pid not in before_children]
    assert left == [], "cancelled creates left processes"
    assert host_state() == before


async def test_daemons_die_with_the_sandbox(sandbox: nsbox.Sandbox) -> None:
    await sandbox.exec(["sh", "-c", ESCAPERS])
    ns = pidns(sandbox.pid)
    assert len(members(ns)) >= 3
    await sandbox.close()
    assert wait_until_empty(ns) == []


OWNER = textwrap.dedent("""
    import anyio, json, os, nsbox
    async def main():
        sb = await nsbox.Sandbox.create()
        await sb.exec(["sh", "-c", {escapers!r}])
        print(json.dumps({{"ns": os.readlink(f"/proc/{{sb.pid}}/ns/pid"), "id": sb.id}}), flush=True)
        await anyio.sleep(1000)
    anyio.run(main)
""")


def test_sigkill_of_the_owner_leaves_no_process() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(escapers=ESCAPERS)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        assert len(members(info["ns"])) >= 3
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert wait_until_empty(info["ns"], 5) == []
        # The live-sandbox list now shows an entry whose owner is gone (for `nsbox gc`).
        # The init leaves its namespaces before it has finished exiting
        # (unmounting its tree): allow it that moment.
        deadline = time.monotonic() + 5
        while (entry := live.read(info["id"])) is not None and entry.init_alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert entry is not None and not entry.owner_alive and not entry.init_alive
    finally:
        owner.kill()
        owner.wait()


CLOSER = textwrap.dedent("""
    import anyio, nsbox
    async def main():
        layers = []
        for i in range(3):
            sb = await nsbox.Sandbox.create()
            # Many files: deleting this layer takes a while on the sweeper's thread.
            r = await sb.exec(["sh", "-c", "mkdir -p /root/d && cd /root/d && seq 1 3000 | xargs touch"])
            assert r.success, r.stderr
            layers.append(str(sb._layer))
            await sb.close()
        print("\\n".join(layers), flush=True)
    anyio.run(main)
""")


@pytest.mark.timeout(120)
def test_a_process_exiting_right_after_close_leaves_no_layer() -> None:
    """close() returns once the sandbox's processes are gone; its layer is
    deleted on a thread. A process that exits at once still deletes them
    all before it ends."""
    r = subprocess.run([sys.executable, "-c", CLOSER], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    layers = r.stdout.split()
    assert len(layers) == 3
    assert [layer for layer in layers if os.path.exists(layer)] == []
    assert r.stderr == ""


async def test_init_is_pid_one_and_tiny(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["cat", "/proc/1/comm", "/proc/1/status"])
    assert r.stdout.startswith("nsbox-init\n")
    rss_kib = int(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("VmRSS")))
    assert rss_kib < 1024, f"the init uses {rss_kib} KiB"


async def test_the_first_command_sees_only_the_init_and_itself() -> None:
    """The setup's last helper (the one that holds the nested namespaces
    while their maps are written, csrc/create/lock.c) is not waited for
    during the setup; the init reaps it before it serves anything, so no
    command ever sees it, running or as a zombie."""
    for _ in range(15):
        async with nsbox.Sandbox() as sb:
            r = await sb.exec(["sh", "-c", "cd /proc && echo [0-9]*"])
            pids = r.stdout.split()
            assert len(pids) == 2 and "1" in pids, r.stdout  # the init and this sh


async def test_setup_failure_leaves_nothing(tmp_path: Path) -> None:
    # A root filesystem whose /dev is a symlink to a host directory: setup
    # must refuse it (a mount there would follow the link) and clean up.
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (rootfs / "dev").symlink_to(victim)
    layers = dirs.data_dir() / "sandboxes"
    before = set(os.listdir(layers)) if layers.exists() else set()
    with pytest.raises(nsbox.SandboxSetupError, match="/dev"):
        await nsbox.Sandbox(rootfs).start()
    assert removal.wait_swept(10)
    assert list(victim.iterdir()) == []
    assert (set(os.listdir(layers)) if layers.exists() else set()) == before
    # No sandbox process is left (other tests' helpers, e.g. a registry
    # server, may be children of this process too).
    assert not [c.pid for c in psutil.Process().children()
                if c.name() in ("nsbox-init", "nsbox-create") and c.pid not in zygote.helper_pids()]


async def test_a_layer_failing_while_the_zygote_clones_leaves_nothing(monkeypatch) -> None:
    """With a cached plan the layer is prepared after the request went to
    the zygote (launch's before_go). If that fails, the cloned process gets
    no go: it exits without running a step, is reaped, and its layer and
    live entry go; the next sandbox is fine."""
    from nsbox.create import launch as launch_mod, procedure
    from nsbox.plan import rootfs as rootfs_mod

    async with nsbox.Sandbox():  # the plan's template, the zygote and the holder exist from here
        pass
    before = host_state()
    seen: dict[str, object] = {}
    real_launch = launch_mod.launch

    async def spying_launch(plan, launched, **kw):
        seen["before_go"] = kw.get("before_go")
        try:
            await real_launch(plan, launched, **kw)
        finally:
            seen["pid"] = launched.pid

    def broken_prepare(self, layer, hostname, owner) -> None:
        layer.mkdir(mode=0o700)  # half made, as a full disk would leave it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(procedure, "launch", spying_launch)
    monkeypatch.setattr(rootfs_mod.HostRootfs, "prepare", broken_prepare)
    with pytest.raises(nsbox.ResourceExhausted, match="no space left"):  # named as the limit it is
        await nsbox.Sandbox().start()
    assert seen["before_go"] is not None, "the layer was not prepared while the zygote cloned"
    pid = seen["pid"]
    assert isinstance(pid, int) and pid > 0  # it was cloned...
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ...and reaped
    assert host_state() == before
    monkeypatch.undo()
    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["true"])).success


async def test_many_sandboxes_at_once() -> None:
    boxes = []
    try:
        async with anyio.create_task_group() as tg:
            async def make() -> None:
                boxes.append(await nsbox.Sandbox.create())
            for _ in range(10):
                tg.start_soon(make)
        outputs = [(await b.exec(["hostname"])).stdout.strip() for b in boxes]
        assert outputs == [b.hostname for b in boxes] and len(set(outputs)) == 10
    finally:
        for b in boxes:
            await b.close()


FORKER = textwrap.dedent("""
    import json, os, time, anyio, nsbox
    async def main():
        sb = await nsbox.Sandbox.create()
        await sb.exec(["true"])
        await sb.spawn(["sleep", "1000"])
        child = os.fork()  # without exec: a worker of a multiprocessing pool, say
        if child == 0:
            time.sleep(1000)
            os._exit(0)
        print(json.dumps({"ns": os.readlink(f"/proc/{sb.pid}/ns/pid"), "child": child}), flush=True)
        await anyio.sleep(1000)
    anyio.run(main)
""")


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_keep_its_parents_sandboxes_alive() -> None:
    """The lifeline is the owner's: a child forked without exec drops its
    copy, so the sandbox ends with the owner even while the child lives."""
    owner = subprocess.Popen([sys.executable, "-c", FORKER], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        child = info["child"]
        assert len(members(info["ns"])) >= 2
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert psutil.pid_exists(child)
        assert wait_until_empty(info["ns"], 5) == []
    finally:
        owner.kill()
        owner.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def test_an_idle_sandbox_holds_no_descriptor_and_serves_the_next_request() -> None:
    """Its control connection closes after a while without requests (on
    asyncio by a timer; on trio at the process's next request, here
    another sandbox's); the sandbox lives on (its lifeline is the owner's
    pipe) and the next request reconnects."""
    from nsbox.init import client as init_client

    def fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    async with nsbox.Sandbox() as other:
        await other.exec(["true"])  # the process's own descriptors (zygote, lifeline, epolls), its connection
        before = len(os.listdir("/proc/self/fd"))
        async with nsbox.Sandbox() as sb:
            assert len(os.listdir("/proc/self/fd")) <= before, fds()  # made: nothing held
            assert (await sb.exec(["sh", "-c", "echo $$ > /tmp/pid; sleep 1000 &"])).success
            assert sb._client is not None and sb._client.connected
            with anyio.fail_after(init_client.IDLE_CLOSE + 5):
                while sb._client.connected:
                    await anyio.sleep(0.1)
                    await other.exec(["true"])
            assert len(os.listdir("/proc/self/fd")) <= before, fds()
            # Still alive, its processes too; the next request reconnects.
            assert sb.running
            assert (await sb.exec(["sh", "-c", "pgrep -x sleep"])).stdout.strip()
            assert await sb.read_file("/tmp/pid")
        assert not sb.running


THREADS = textwrap.dedent("""
    import asyncio, collections, json, sys, threading, time
    import anyio, nsbox
    from nsbox.init import client as C

    stress = sys.argv[1] == "stress"
    if stress:
        C.IDLE_CLOSE = 0.003  # sweeps all the time
        sys.setswitchinterval(1e-5)  # threads switch between any two bytecodes
    errors = collections.Counter()
    timers = {}
    together = threading.Barrier(3)

    def pending_idle_timers(loop):
        return sum(1 for h in loop._scheduled if not h.cancelled()
                   and getattr(h._callback, "__func__", None) is C.IdleConnections._fire)

    def worker(name, backend):
        async def main():
            if backend == "asyncio":
                asyncio.get_running_loop().set_exception_handler(
                    lambda loop, ctx: errors.update([f"{name} timer: {ctx.get('exception')!r}"]))
            async with nsbox.Sandbox() as a, nsbox.Sandbox() as b:
                together.wait()
                t0 = time.monotonic()
                while time.monotonic() - t0 < (4 if stress else 1):  # (else within IDLE_CLOSE)
                    for sb in (a, b):
                        try:
                            r = await sb.exec(["true"])
                            assert r.success, r
                        except Exception as e:
                            errors[f"{name} exec: {e!r}"] += 1
                    await anyio.sleep(0.003 if stress else 0.02)
                if backend == "asyncio":
                    timers[name] = pending_idle_timers(asyncio.get_running_loop())
        anyio.run(main, backend=backend)

    threads = [threading.Thread(target=worker, args=args) for args in
               (("A", "asyncio"), ("B", "asyncio"), ("C", "trio"))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("RESULT", json.dumps({"errors": dict(errors), "timers": timers}))
""")


@pytest.mark.once  # the host's registry of connections, shared by threads
@pytest.mark.timeout(120)
@pytest.mark.parametrize("load", ["stress", "timers"])
def test_sandboxes_used_from_several_threads(load: str) -> None:
    """Sandboxes used from three threads at once (two asyncio loops, one
    trio). With the idle sweep running all the time, no request fails (the
    registry of open connections was shared without a lock: KeyError out
    of exec, a connection closed under another thread's request). Within
    IDLE_CLOSE, each loop has one idle timer (each request from another
    loop than the last had added one)."""
    out = script_result(THREADS, load, timeout=100)
    assert out["errors"] == {}
    if load == "timers":
        assert out["timers"] == {"A": 1, "B": 1}


async def test_reconnecting_out_of_descriptors_is_not_a_dead_sandbox() -> None:
    """A request that must reopen the connection and meets RLIMIT_NOFILE
    raises EMFILE, not "the sandbox is not running"; the sandbox serves the
    next request."""
    import resource

    from nsbox.init import client as init_client

    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["true"])).success
        client = sb._client
        assert client is not None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        errors = []
        for extra in range(8):  # each descriptor the request opens in turn
            client.disconnect()  # as the idle timer does
            init_client.IDLE.forget(client)
            used = {int(fd) for fd in os.listdir("/proc/self/fd")}
            free = [n for n in range(max(used) + 16) if n not in used]
            resource.setrlimit(resource.RLIMIT_NOFILE, (free[extra], hard))
            try:
                await sb.exec(["true"])
            except Exception as e:
                errors.append(e)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert errors and all(isinstance(e, OSError) and e.errno == errno.EMFILE for e in errors), errors
        assert sb.running
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"


@pytest.mark.parametrize("other_state", ["running", "exited"])
@pytest.mark.parametrize("descriptors", ["pidfd", "none to spare"])
async def test_closing_after_someone_else_reaped_the_init(descriptors: str, other_state: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The init of a running sandbox is watched through no descriptor; if
    something else in the process reaps it (a waitpid(-1) of the user's)
    and its pid goes to another process, closing the sandbox leaves that
    process alone, running or exited and not yet reaped (here the pid is
    handed to a child of the test's, as reuse would)."""
    from nsbox.create import launch

    if descriptors != "pidfd":
        monkeypatch.setattr(launch.rlimits, "descriptor_share", lambda: 0)  # closes poll instead
    other = None
    try:
        async with nsbox.Sandbox() as sb:
            launched = sb._launched
            assert launched is not None and launched.pidfd < 0  # no descriptor watches it
            await anyio.sleep(0.05)  # start times count in ticks of 10 ms: a later one
            other = subprocess.Popen(["sleep", "60"] if other_state == "running" else ["sh", "-c", "exit 7"])
            if other_state == "exited":  # a zombie of ours
                os.waitid(os.P_PID, other.pid, os.WEXITED | os.WNOWAIT)
            os.kill(launched.pid, signal.SIGKILL)
            os.waitpid(launched.pid, 0)  # the user's reaping
            launched.pid = other.pid  # the pid reused
        if other_state == "running":
            assert other.poll() is None  # neither killed nor reaped
        else:
            assert other.wait(5) == 7  # its status is still its owner's to take
    finally:
        if other is not None:
            other.kill()
            other.wait()


async def test_closing_without_a_descriptor_to_spare_ends_the_sandbox() -> None:
    """Closed while this process can open no descriptor (not a pidfd, not
    /proc/PID/stat), the sandbox still ends: what cannot be checked is not
    taken for "someone else reaped the init" (its layer would have been
    reused while it ran)."""
    import resource

    sb = await nsbox.Sandbox.create()
    try:
        assert (await sb.exec(["true"])).success
        pid = sb.pid
        assert sb._client is not None
        sb._client.disconnect()  # as the idle timer does: closing needs no connection
        used = {int(fd) for fd in os.listdir("/proc/self/fd")}
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n for n in range(max(used) + 2) if n not in used), hard))
        try:
            await sb.close()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert not os.path.exists(f"/proc/{pid}")
    finally:
        await sb.close()


PIDFDS = textwrap.dedent("""
    import anyio, json, os, nsbox
    from nsbox.create import zygote

    def pidfds():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:  # (the listing's own descriptor, and the sweeper thread's, come and go)
                if "pidfd" in os.readlink(f"/proc/self/fd/{fd}"):
                    found.append(fd)
            except FileNotFoundError:
                pass
        return found

    async def main():
        async with nsbox.Sandbox() as sb:
            assert (await sb.exec(["true"])).success
        print("RESULT " + json.dumps({"holders": len(zygote._holders), "pidfds": pidfds()}))

    anyio.run(main)
""")


@pytest.mark.timeout(60)
def test_a_closed_sandbox_leaves_no_pidfd() -> None:
    """Made and closed in a fresh process, a sandbox leaves no pidfd open:
    not its init's, nor the holder's that made its user namespace (where
    the id mapping uses one: it had been kept, unread, for good)."""
    out = script_result(PIDFDS, timeout=50)
    assert out["pidfds"] == [], out


FORK_WHILE_HELD = textwrap.dedent("""
    import anyio, os, threading, time, nsbox
    from nsbox.init import client as C

    async def make():
        sb = await nsbox.Sandbox.create()
        assert (await sb.exec(["true"])).success  # its connection is open
        return sb

    sb = anyio.run(make)
    held, release = threading.Event(), threading.Event()

    def holder():
        with C.IDLE.lock:  # as a thread in the middle of a request
            held.set()
            release.wait()

    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        async def use():
            return (await sb.exec(["echo", "child"])).stdout.strip()
        try:
            out = anyio.run(use)
        except BaseException as e:
            out = repr(e)
        os.write(1, f"CHILD {out}\\n".encode())
        os._exit(0)
    release.set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.05)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
            print("CHILD HUNG", flush=True)
    print("PARENT", anyio.run(lambda: sb.exec(["echo", "parent"])).stdout.strip(), flush=True)
    anyio.run(sb.close)
""")


@pytest.mark.timeout(60)
def test_a_child_forked_mid_request_uses_sandboxes_on_its_own_connections() -> None:
    """Forked while another thread held the registry's lock, a child's
    request neither hangs (the lock is new in the child) nor shares its
    parent's connection; the parent's requests go on."""
    r = subprocess.run([sys.executable, "-c", FORK_WHILE_HELD], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CHILD child" in r.stdout and "PARENT parent" in r.stdout, r.stdout + r.stderr[-2000:]


async def test_a_cancelled_status_leaves_no_answer_for_the_next_request() -> None:
    """A status request cancelled after it was sent left its answer on the
    control connection: every later status read the one before it."""
    async with nsbox.Sandbox() as sb:
        await sb.exec(["true"])
        for turns in range(1, 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sb.status)
                for _ in range(turns):  # cancelled at another point of its exchange each time
                    await anyio.sleep(0)
                tg.cancel_scope.cancel()
            before = (await sb.status())["execs"]
            await sb.exec(["true"])
            await sb.exec(["true"])
            assert (await sb.status())["execs"] == before + 2
