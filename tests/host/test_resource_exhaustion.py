"""A limit reached while creating a sandbox is a user error, not a traceback.

Each scenario runs in a fresh interpreter (its limits, namespaces and
mounts are its own; pytest's process is left alone): it creates sandbox A,
reaches a real limit, tries to create more, lifts the limit, and reports
as JSON what each try raised and what was left behind. The tests assert
that the error is nsbox's ResourceExhausted naming the limit and its fix,
that a failed creation leaves no process, no descriptor in the creating
process, no runtime directory, layer or live entry, and that A still runs
commands afterwards.

The limits: RLIMIT_NOFILE (lowered to just above the descriptors in use,
then one more at a time, so that every descriptor creation takes its turn
to fail; and that of the processes that clone sandboxes lowered below
what a sandbox's setup needs; and, for `nsbox run`, below that from the
start); processes (RLIMIT_NPROC of the processes that clone sandboxes,
for an unprivileged user; root ignores RLIMIT_NPROC, so as root a pids
cgroup whose pids.max is reached); user.max_user_namespaces (lowered in a
user namespace the scenario creates: the sysctl is per user namespace and
limits its descendants); a full filesystem (tmpfs mounts the scenario
makes in its own user and mount namespaces under NSBOX_STATE_DIR).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.conftest import script_result
from tests.imagekit import Registry, busybox_oci, push, registry  # noqa: F401

# Shared by the scenarios: what a failed creation must not leave, and A's health.
PRELUDE = textwrap.dedent("""
    import ctypes, errno, json, os, resource, sys
    libc = ctypes.CDLL(None, use_errno=True)

    def own_namespaces(flags):
        '''A user namespace (and more, in `flags`) of our own, our ids mapped
        to themselves: it must come before any thread.'''
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(0x10000000 | flags) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        for f, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{f}", "w") as fh:
                fh.write(text)

    def run_scenario(body):
        import anyio, nsbox
        from nsbox.create import zygote
        from nsbox.host import dirs, layers, live, removal

        def fds():
            '''Our descriptors, but the spare set the next exec takes: one
            per process, made and used up as execs come (nsbox/init/execfds.py).'''
            from nsbox.init import execfds
            s = execfds._spare
            spare = {s.out_r, s.out_w, s.err_r, s.err_w, s.chan.fileno(), s.chan_child.fileno()} if s else set()
            return sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) not in spare)

        def target(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return "?"

        def children():
            import psutil
            return sorted(p.pid for p in psutil.Process().children(recursive=True))

        def state():
            '''The sandboxes' runtime directories, layers and live entries.'''
            removal.wait_swept(60)
            return {"run": {n for n in os.listdir(dirs.runtime_dir()) if len(n) == 12},
                    "layers": {n for n in os.listdir(layers.layers_dir()) if len(n) == 12},
                    "live": {e.id for e in live.entries()}}

        async def attempt(out, a, create=None, limit=None, **options):
            '''Tries to create a sandbox (`create`: another way, which returns
            how to close it) with `limit` (a function that sets it and returns
            one that lifts it); records what happened and what it left.'''
            async def sandbox():
                return (await nsbox.Sandbox.create(**options)).close
            before, before_fds, before_children = state(), fds(), children()
            rec = {}
            lift = limit() if limit else None
            try:
                try:
                    close = await (create or sandbox)()
                finally:
                    if lift:
                        lift()
            except BaseException as e:
                rec.update(type=type(e).__name__, message=str(e), limit=getattr(e, "limit", None),
                           nsbox=isinstance(e, nsbox.NsboxError))
            else:
                rec["type"] = None
                await close()
            if rec["type"] is not None:  # measured once the error is gone, as a caller that handled it
                import gc, time
                gc.collect()
                for _ in range(50):  # the sweeper thread may still be removing what was made
                    if len(fds()) <= len(before_fds):
                        break
                    time.sleep(0.1)
                rec["fd_growth"] = len(fds()) - len(before_fds)
                rec["left"] = {k: sorted(v - before[k]) for k, v in state().items()}
                rec["fd_delta"] = [f"{fd} {target(fd)}" for fd in sorted(set(fds()) - set(before_fds))]
                rec["child_delta"] = sorted(set(children()) - set(before_children) - zygote.helper_pids())
            out["tries"].append(rec)
            return rec

        async def main():
            out = {"tries": []}
            a = await nsbox.Sandbox.create(**OPTIONS)
            out["a_before"] = (await a.exec(["echo", "A"])).stdout.strip()
            await body(out, a, attempt, zygote)
            out["a_after"] = (await a.exec(["echo", "A"])).stdout.strip()
            out["again"] = (await attempt(out, a, **OPTIONS))["type"]
            out["tries"].pop()
            await a.close()
            print("RESULT " + json.dumps(out), flush=True)

        anyio.run(main)
""")


def run(scenario: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 150) -> dict:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    script = PRELUDE + textwrap.dedent(scenario)
    r = subprocess.run([sys.executable, "-c", script, str(state), *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "NSBOX_STATE_DIR": str(state), **(env or {})})
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"scenario failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def check_failures(out: dict, limit: str, *words: str) -> list[dict]:
    """The failed tries: each nsbox's ResourceExhausted naming `limit` and
    `words`, each leaving nothing behind, no descriptor either; A ran before
    and after."""
    failed = [t for t in out["tries"] if t["type"] is not None]
    assert failed, f"no creation failed: {out}"
    for t in failed:
        assert t["type"] == "ResourceExhausted" and t["nsbox"], t
        assert t["limit"] == limit, t
        for word in words:
            assert word in t["message"], t
        assert "\n" not in t["message"] and "Traceback" not in t["message"], t
        assert t["left"] == {"run": [], "layers": [], "live": []}, t
        assert t["fd_delta"] == [], t
        assert t["child_delta"] == [], t
    assert out["a_before"] == out["a_after"] == "A"
    assert out["again"] is None, "creating a sandbox once the limit was lifted failed"
    return failed


NOFILE = """
    OPTIONS = {}
    async def body(out, a, attempt, zygote):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # raised by nsbox to the hard limit
        for more in range(0, 24):
            def limit():
                resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1 + more, hard))
                return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await attempt(out, a, limit=limit)
        # The processes that clone sandboxes (their children inherit their
        # limit) below what a sandbox's setup needs: refused up front.
        helpers = sorted(zygote.helper_pids())
        saved = {pid: resource.prlimit(pid, resource.RLIMIT_NOFILE) for pid in helpers}
        def helpers_limit():
            for pid in helpers:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (100, saved[pid][1]))
            return lambda: [resource.prlimit(pid, resource.RLIMIT_NOFILE, saved[pid]) for pid in helpers]
        out["helpers"] = await attempt(out, a, limit=helpers_limit)
        out["tries"].pop()  # checked on its own
    run_scenario(body)
"""


@pytest.mark.timeout(200)
def test_descriptor_limit_at_each_descriptor(tmp_path: Path) -> None:
    """RLIMIT_NOFILE reached at each descriptor creating a sandbox opens in
    turn: one error naming the limit and `ulimit -n`, nothing leaked."""
    out = run(NOFILE, tmp_path)
    failed = check_failures(out, "RLIMIT_NOFILE", "too many open files", "RLIMIT_NOFILE soft", "ulimit -n")
    assert len(failed) >= 5, "expected several descriptors of the creation to take their turn to fail"
    assert out["tries"][-1]["type"] is None, "creation never succeeded within the tries"
    check_failures({**out, "tries": [out["helpers"]]}, "RLIMIT_NOFILE", "below the 256", "nsbox-create's soft limit 100")


NETWORK = """
    OPTIONS = {}
    async def body(out, a, attempt, zygote):
        import nsbox
        async with nsbox.Network("exh", internal=True) as net:
            first = await nsbox.Sandbox.create(network=net, hostname="first")
            try:
                out["members"] = []
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                for more in range(0, 24):
                    def limit():
                        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1 + more, hard))
                        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                    await attempt(out, a, limit=limit, network=net, hostname="second")
                    out["members"].append([sorted(net.members), sorted(net._net.members)])
                r = await first.exec(["cat", "/etc/hosts"])
                out["hosts"] = r.stdout
            finally:
                await first.close()
    run_scenario(body)
"""


@pytest.mark.timeout(200)
def test_descriptor_limit_on_a_service_network(tmp_path: Path) -> None:
    """The same on a service network: a member that could not be made is
    no member (neither in this process nor in the network's worker), and
    the member there keeps its view of the network."""
    out = run(NETWORK, tmp_path)
    assert len(check_failures(out, "RLIMIT_NOFILE", "too many open files")) >= 5
    assert out["tries"][-1]["type"] is None, "creation never succeeded within the tries"
    assert all(m == [["first"], ["first"]] for m in out["members"]), out["members"]
    assert "second" not in out["hosts"], out["hosts"]


NPROC = """
    OPTIONS = {}
    async def body(out, a, attempt, zygote):
        # The processes that clone sandboxes: the zygote and its holders.
        helpers = sorted(zygote.helper_pids())
        if sys.argv[2] == "rlimit":
            saved = {pid: resource.prlimit(pid, resource.RLIMIT_NPROC) for pid in helpers}
            for pid in helpers:
                resource.prlimit(pid, resource.RLIMIT_NPROC, (1, saved[pid][1]))
            try:
                await attempt(out, a)
                await attempt(out, a)
            finally:
                for pid in helpers:
                    resource.prlimit(pid, resource.RLIMIT_NPROC, saved[pid])
        else:  # a pids cgroup (v1 or v2 path in argv[3]) holding the helpers, full
            cg = sys.argv[3]
            os.mkdir(cg)
            try:
                for pid in helpers:
                    with open(f"{cg}/cgroup.procs", "w") as f:
                        f.write(str(pid))
                with open(f"{cg}/pids.max", "w") as f:
                    f.write(open(f"{cg}/pids.current").read().strip())
                await attempt(out, a)
                await attempt(out, a)
            finally:
                parent = os.path.dirname(cg)
                for pid in helpers:
                    with open(f"{parent}/cgroup.procs", "w") as f:
                        f.write(str(pid))
                os.rmdir(cg)
    run_scenario(body)
"""


def _pids_cgroup_root() -> Path | None:
    """The directory of this process's pids cgroup (v1, or v2 with the
    pids controller), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "pids" in controllers.split(","):
            return Path("/sys/fs/cgroup/pids") / rel.lstrip("/")
        if controllers == "":
            d = Path("/sys/fs/cgroup") / rel.lstrip("/")
            if (d / "pids.max").exists() or "pids" in _read(d / "cgroup.subtree_control"):
                return d
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.timeout(120)
def test_process_limit(tmp_path: Path, mode: str) -> None:
    """No process can be cloned: as a user, RLIMIT_NPROC of the processes
    that clone sandboxes; as root (whom RLIMIT_NPROC does not hold), a
    pids cgroup whose pids.max is reached."""
    if mode == "root":
        root = _pids_cgroup_root()
        if root is None or not os.access(root, os.W_OK):
            pytest.fail("as root, this test needs a writable pids cgroup (RLIMIT_NPROC does not hold root)")
        out = run(NPROC, tmp_path, "cgroup", str(root / f"nsbox-test-{uuid.uuid4().hex[:8]}"))
        check_failures(out, "pids.max", "pids.max", "pids.current")
    else:
        out = run(NPROC, tmp_path, "rlimit")
        check_failures(out, "RLIMIT_NPROC", "RLIMIT_NPROC soft 1", "ulimit -u")


USERNS = """
    own_namespaces(0)
    OPTIONS = {"id_mapping": "single"}
    SYSCTL = "/proc/sys/user/max_user_namespaces"
    async def body(out, a, attempt, zygote):
        saved = open(SYSCTL).read()
        with open(SYSCTL, "w") as f:
            f.write("1")  # fewer than sandbox A holds already
        try:
            await attempt(out, a, **OPTIONS)
            await attempt(out, a, **OPTIONS)
        finally:
            with open(SYSCTL, "w") as f:
                f.write(saved)
    run_scenario(body)
"""


@pytest.mark.timeout(120)
def test_user_namespace_limit(tmp_path: Path) -> None:
    """user.max_user_namespaces reached (in a user namespace of the test's,
    whose own value of the sysctl limits the namespaces made in it)."""
    out = run(USERNS, tmp_path)
    check_failures(out, "user.max_user_namespaces", "user.max_user_namespaces is 1", "sysctl -w")


DISK = """
    own_namespaces(0x20000)  # and a mount namespace, for tmpfs
    OPTIONS = {"id_mapping": "single"}
    state = sys.argv[1]
    MS_PRIVATE, MS_REC = 1 << 18, 1 << 14
    assert libc.mount(b"none", b"/", None, MS_PRIVATE | MS_REC, None) == 0
    for d in ("run", "data"):
        os.mkdir(f"{state}/{d}", 0o700)
        if libc.mount(b"tmpfs", f"{state}/{d}".encode(), b"tmpfs", 0, b"size=8m,nr_inodes=4096,mode=0700") != 0:
            raise OSError(ctypes.get_errno(), "mount tmpfs")

    def fill(d, inodes=True, leave=0):
        '''Takes every block (and inode) of the tmpfs at `d`, but `leave` bytes.'''
        os.mkdir(f"{d}/filler")
        try:
            with open(f"{d}/filler/blocks", "wb") as f:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        os.truncate(f"{d}/filler/blocks", max(0, os.path.getsize(f"{d}/filler/blocks") - leave))
        n = 0 if inodes else None
        try:
            while n is not None:
                open(f"{d}/filler/{n}", "w").close()
                n += 1
        except OSError as e:
            assert e.errno == errno.ENOSPC, e

    def unfill(d):
        import shutil
        shutil.rmtree(f"{d}/filler")

    async def body(out, a, attempt, zygote):
        image = sys.argv[2] if len(sys.argv) > 2 else None
        # With an image: room for its directories and none for its files,
        # then room for its compressed layer but not for it unpacked.
        cases = [("data", 0), ("data", 1536 << 10), ("data", 1536 << 10)] if image else [("run", 0), ("data", 0)]
        for d, leave in cases:
            fill(f"{state}/{d}", inodes=not image, leave=leave)
            try:
                rec = await attempt(out, a, **OPTIONS, **({"image": image} if image else {}))
                rec["full"] = d
                if image:  # what a pull that ran out of room leaves in the image store
                    images = f"{state}/data/images"
                    rec["images"] = sorted(
                        os.path.relpath(os.path.join(top, n), images) for top, dirs, files in os.walk(images)
                        for n in dirs + files if top.endswith("/tmp") or ".staging" in n)
                    rec["blobs"] = len(os.listdir(f"{images}/blobs/sha256")) if os.path.isdir(f"{images}/blobs/sha256") else 0
            finally:
                unfill(f"{state}/{d}")
    run_scenario(body)
"""


@pytest.mark.timeout(120)
def test_full_filesystem(tmp_path: Path) -> None:
    """The runtime directory's filesystem full, then the one of the
    writable layers: the error names the filesystem and NSBOX_STATE_DIR."""
    out = run(DISK, tmp_path)
    failed = check_failures(out, "disk space", "no space left", "NSBOX_STATE_DIR")
    assert sorted(t["full"] for t in failed) == ["data", "run"]
    for t in failed:
        assert f"/state/{t['full']}" in t["message"], t


@pytest.mark.timeout(60)
def test_cli_one_line_exit_125(tmp_path: Path) -> None:
    """`nsbox run` under a descriptor limit too low for a sandbox's setup
    (its hard limit too: nsbox raises the soft one to it): one line naming
    the limit and the fix, status 125, nothing left."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    r = subprocess.run(["sh", "-c", 'ulimit -n 100 && exec "$0" -m nsbox run -- echo hi', sys.executable],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "NSBOX_STATE_DIR": str(state)})
    assert r.returncode == 125, (r.returncode, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "limit of open files is below the 256" in lines[0] and "RLIMIT_NOFILE soft 100, hard 100" in lines[0], r.stderr
    assert "ulimit -Hn" in lines[0], r.stderr
    assert not [n for p in state.rglob("*") for n in [p.name] if len(n) == 12], "a failed run left something"


@pytest.mark.timeout(200)
def test_inspect_provider_names_the_limit(tmp_path: Path) -> None:
    """The Inspect provider's sample_init at the descriptor limit raises
    nsbox's error naming it (Inspect records it as the sample's error, its
    message the one line), and leaves nothing behind."""
    pytest.importorskip("inspect_ai")
    scenario = """
        OPTIONS = {}
        async def body(out, a, attempt, zygote):
            from nsbox.inspect.provider import NsboxSandboxEnvironment as Env
            async def sample():
                envs = await Env.sample_init("t", None, {})
                return lambda: Env.sample_cleanup("t", None, envs, False)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            for more in range(0, 24):
                def limit():
                    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1 + more, hard))
                    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                await attempt(out, a, sample, limit)
        run_scenario(body)
    """
    out = run(scenario, tmp_path)
    check_failures(out, "RLIMIT_NOFILE", "too many open files", "RLIMIT_NOFILE soft")


@pytest.mark.timeout(120)
@pytest.mark.needs("docker-registry", "skopeo", "umoci")
def test_full_filesystem_while_pulling_an_image(tmp_path: Path, registry: Registry, busybox_oci: Path) -> None:  # noqa: F811
    """A sandbox of an image not yet pulled, the image store's filesystem
    full: the same error, and no half-stored blob or unpacked layer left."""
    push(f"oci:{busybox_oci}:plain", registry, "exhaust/busybox:1")
    out = run(DISK, tmp_path, f"{registry.host}/exhaust/busybox:1")
    download, unpack, again = check_failures(out, "disk space", "no space left", "NSBOX_STATE_DIR")
    for t in (download, unpack, again):
        assert "/state/data" in t["message"], t
        assert t["images"] == [], t
    assert unpack["blobs"] > download["blobs"], "the second pull did not get as far as unpacking"


EXEC_NOFILE = textwrap.dedent("""
    import json, os, resource
    import anyio, nsbox

    def open_fds():
        return {int(fd): os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    async def main():
        async with nsbox.Sandbox() as sb:
            big = {"BIG": "x" * 100_000}  # over the inline request size: its payload travels in a memfd
            assert (await sb.exec(["true"], env=big)).success
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            tries = []
            for more in range(8):
                before = open_fds()
                # The limit bounds descriptor numbers: the (more+1)-th new
                # descriptor takes the (more+1)-th free number, and fails.
                free = [n for n in range(max(before) + 16) if n not in before]
                resource.setrlimit(resource.RLIMIT_NOFILE, (free[more], hard))
                try:
                    r = await sb.exec(["true"], env=big)
                    error = None if r.success else r.stderr
                except Exception as e:  # the limit, as the caller sees it
                    error = f"{type(e).__name__}: {e}"
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                # What is left, but for the pipes and channel nsbox keeps
                # ready for the next exec (nsbox/init/execfds.py).
                left = {fd: what for fd, what in open_fds().items()
                        if fd not in before and not what.startswith(("pipe:", "socket:"))}
                tries.append({"error": error, "left": left})
            again = (await sb.exec(["echo", "A"], env=big)).stdout
        print("RESULT " + json.dumps({"tries": tries, "again": again}))

    anyio.run(main)
""")


@pytest.mark.timeout(120)
def test_descriptor_limit_during_an_exec_leaks_nothing(tmp_path: Path) -> None:
    """An exec that meets RLIMIT_NOFILE at each descriptor it opens in turn
    (its request's memfd, channel, pipes) fails and leaves no memfd open
    (the pipes and channel it keeps ready for the next exec aside); the
    sandbox serves the next exec."""
    out = script_result(EXEC_NOFILE, timeout=100, env={**os.environ, "NSBOX_STATE_DIR": str(tmp_path)})
    assert any(t["error"] for t in out["tries"]), out  # the limit was met
    assert [t["left"] for t in out["tries"]] == [{}] * len(out["tries"]), out["tries"]
    assert out["again"] == "A\n"
