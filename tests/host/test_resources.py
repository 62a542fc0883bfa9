"""Resource limits (nsbox/plan/resources.py): memory, pids_limit, cpus, disk.

As root here they are cgroup v1 limits; as an unprivileged user (no
delegated cgroup on this host) they fall back to rlimits, and nsbox says so.
Tests take `how` from what this host offers, and check each limit holds.

NSBOX_TEST_SWITCH_OFF=resources runs these tests with the enforcement
switched off: the protection tests must then fail (see the report).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

import nsbox
from nsbox import errors
from nsbox.host import layers, live
from nsbox.plan import resources
from nsbox.errors import HostPrerequisiteError

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "_said", set())  # each test sees the warnings it causes
    if "resources" in os.environ.get("NSBOX_TEST_SWITCH_OFF", ""):
        monkeypatch.setattr(resources, "enabled", False)


def by_cgroup(limit: str) -> bool:
    return limit in resources.support().cgroups


# ---- enforcement -----------------------------------------------------------

def leftover_cgroups(sandbox_id: str) -> list[str]:
    return [str(Path(parent) / f"nsbox-{sandbox_id}") for _, parent in resources.support().cgroups.values()
            if (Path(parent) / f"nsbox-{sandbox_id}").exists()]


async def test_no_limits_nothing_created(capfd: pytest.CaptureFixture[str]) -> None:
    async with nsbox.Sandbox() as sb:
        r = await sb.exec(["sh", "-c", "grep -c nsbox- /proc/self/cgroup; df --output=fstype / | tail -1"])
        assert r.stdout.split() == ["0", "overlay"], r
        assert leftover_cgroups(sb.id) == [] and not (sb._rundir / resources.CGROUPS_FILE).exists()  # type: ignore[operator]
        assert sb._launched.cleanups == []
    assert "nsbox: warning" not in capfd.readouterr().err


# Allocates up to 512 MiB, touching every page; exits 0 if it got it all.
HOG = "a = []\nfor _ in range(64): a.append(bytearray(8 << 20))\nprint('got it all')"


@pytest.mark.timeout(60)
async def test_memory_hog(capfd: pytest.CaptureFixture[str]) -> None:
    async with nsbox.Sandbox(memory="64m") as sb:
        r = await sb.exec(["python3", "-c", HOG])
        assert "got it all" not in r.stdout, r
        if by_cgroup("memory"):
            assert r.returncode == 137, r  # killed by the OOM killer, as Docker reports it
        else:
            assert r.returncode != 0 and "MemoryError" in r.stderr, r
        # The sandbox itself lives on.
        assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
        sandbox_id = sb.id
    err = capfd.readouterr().err
    if not by_cgroup("memory"):
        assert "memory is approximated by RLIMIT_AS" in err
        # What it cannot bound, said plainly, once.
        assert err.count("cannot bound memfd or SysV shared memory, pipe or socket buffers") == 1, err
        assert "strict_limits refuses it" in err
    assert leftover_cgroups(sandbox_id) == []


# Writes N MiB of zeros to a file, for the tmpfs tests.
def dd(path: str, mib: int) -> list[str]:
    return ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}"]


@pytest.mark.timeout(60)
async def test_tmpfs_mounts_share_the_memory_limit() -> None:
    """RLIMIT_AS does not count files in a tmpfs: /tmp, /dev/shm and /run
    each a tmpfs of half the host's memory let a 64 MiB sandbox pin
    gigabytes. They share one tmpfs of the memory limit's size."""
    async with nsbox.Sandbox(memory="64m") as sb:
        r = await sb.exec(["stat", "-f", "-c", "%b %S %c", "/tmp", "/dev/shm", "/run", "/dev"])
        found = [[int(x) for x in line.split()] for line in r.stdout.splitlines()]
        assert len(found) == 4 and all(b * bs <= 64 * MiB for b, bs, _ in found), r
        # Empty files take no blocks but memory: inodes are capped too.
        assert all(inodes <= 64 * 1024 for _, _, inodes in found), r
        r = await sb.exec(["stat", "-c", "%d %a", "/tmp", "/dev/shm", "/run"])
        devices, modes = zip(*(line.split() for line in r.stdout.splitlines()))
        assert len(set(devices)) == 1 and modes == ("1777", "1777", "755"), r  # one filesystem: a cap together
        assert (await sb.exec(dd("/tmp/a", 40))).returncode == 0
        for path in ("/dev/shm/b", "/run/b"):  # 40 + 40 > 64
            r = await sb.exec(dd(path, 40))
            assert r.returncode != 0, (path, r)
            if not by_cgroup("memory"):
                assert "No space left on device" in r.stderr, (path, r)
            await sb.exec(["rm", "-f", path])
        # Freed, it is usable again; the sandbox lives on.
        await sb.exec(["rm", "/tmp/a"])
        r = await sb.exec(["sh", "-c", f"{' '.join(dd('/dev/shm/c', 40))} 2>/dev/null && echo ok"])
        assert r.stdout == "ok\n", r


@pytest.mark.timeout(60)
async def test_strict_limits(tmp_path: Path) -> None:
    """strict_limits refuses a limit that no cgroup enforces here, with one
    clear line and nothing left behind; where cgroups enforce them all (as
    root here), the sandbox runs with them."""
    want = {"memory": "64m", "pids_limit": 50, "cpus": 0.5}
    weak = [name for name in want if not by_cgroup(name)]
    args = ["--memory", "64m", "--pids-limit", "50", "--cpus", "0.5"]
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--strict-limits", *args, "--", "echo", "ran"],
                       capture_output=True, text=True, timeout=60)
    if not weak:
        assert r.returncode == 0 and r.stdout == "ran\n" and "warning" not in r.stderr, r
        async with nsbox.Sandbox(strict_limits=True, **want) as sb:  # type: ignore[arg-type]
            assert (await sb.exec(["true"])).success
            assert leftover_cgroups(sb.id) != []
        return
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr, r
    assert len(r.stderr.strip().splitlines()) == 1, r
    assert f"strict_limits: this host cannot enforce {', '.join(weak)}" in r.stderr, r
    before = (sorted(live.runtime_dir().iterdir()), sorted(layers.layers_dir().iterdir()))
    with pytest.raises(HostPrerequisiteError) as e:
        await nsbox.Sandbox.create(strict_limits=True, **want)  # type: ignore[arg-type]
    assert "memory would be approximated by RLIMIT_AS" in str(e.value) and e.value.hint
    assert "nsbox doctor" in e.value.hint and "\n" not in str(e.value)
    assert (sorted(live.runtime_dir().iterdir()), sorted(layers.layers_dir().iterdir())) == before
    # Without it, the same limits are approximated, as before.
    async with nsbox.Sandbox(**want) as sb:  # type: ignore[arg-type]
        assert (await sb.exec(["true"])).success


# Forks until fork fails (or 1000 times): each child sleeps; prints how many.
BOMB = """
import os, time
n = 0
while n < 1000:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        break
    n += 1
print(n)
"""


# A fork bomb that keeps trying (every process forks up to 3 children, 6
# levels deep: at most 1093 processes, should the limit be off).
TREE_BOMB = """
import os, time
depth = forks = 0
while True:
    if depth < 6 and forks < 3:
        try:
            if os.fork() == 0:
                depth, forks = depth + 1, 0
                continue
            forks += 1
        except OSError:
            time.sleep(0.05)
    else:
        time.sleep(0.05)
"""


def sandbox_processes(init_pid: int) -> int:
    """Processes under the sandbox's init, counted from the host."""
    todo, seen = [init_pid], 0
    while todo:
        pid = todo.pop()
        seen += 1
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except FileNotFoundError:
            pass
    return seen


@pytest.mark.timeout(60)
async def test_fork_bomb_stays_inside_its_limit(capfd: pytest.CaptureFixture[str]) -> None:
    limit = 40
    async with nsbox.Sandbox() as other, nsbox.Sandbox(pids_limit=limit) as sb:
        counted: list[int] = []

        async def watch() -> None:
            await anyio.sleep(1.5)
            counted.append(sandbox_processes(sb.pid))
            # Another sandbox, and the host, do not notice.
            with anyio.fail_after(5):
                r = await other.exec(["sh", "-c", "for i in $(seq 50); do /bin/true & done; wait; echo ok"])
            assert r.stdout == "ok\n"

        # A fork bomb, stopped by the exec timeout (which kills its tree).
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            with pytest.raises(nsbox.CommandTimeout):
                await sb.exec(["python3", "-c", TREE_BOMB], timeout=3)
        assert 10 < counted[0] <= limit, counted
        # One that counts its forks.
        with anyio.fail_after(20):
            while True:  # the killed bomb's processes may still be going
                r = await sb.exec(["python3", "-c", BOMB], timeout=15)
                if r.returncode == 0:
                    break
                await anyio.sleep(0.1)
        assert int(r.stdout) < limit, r
        assert sandbox_processes(sb.pid) <= limit
        # A full sandbox still answers (the bomb's parent exited: one slot is free).
        with anyio.fail_after(5):
            await sb.exec(["true"])
        started = time.monotonic()
        sandbox_id = sb.id
    assert time.monotonic() - started < 10  # closing kills the lot
    assert leftover_cgroups(sandbox_id) == []
    if not by_cgroup("pids_limit"):
        assert "pids_limit is approximated by RLIMIT_NPROC" in capfd.readouterr().err


# Forks until fork fails, every process kept.
FILL = "import os, time\nwhile True:\n  try:\n    os.fork() or time.sleep(1000)\n  except OSError:\n    break\nprint('full', flush=True)\ntime.sleep(1000)"


@pytest.mark.timeout(60)
async def test_a_command_that_cannot_start_in_a_full_sandbox_is_a_failed_result() -> None:
    """With every process slot taken (by the model's own commands), the next
    command fails as a result the caller (a model) reads, exit status 126,
    as Docker reports it: it had been an exception that failed the sample."""
    async with nsbox.Sandbox(pids_limit=20) as sb:
        filler = await sb.start_process(["python3", "-c", FILL])
        with anyio.fail_after(20):
            async for event in filler:
                if b"full" in getattr(event, "data", b""):
                    break
        r = await sb.exec(["ls"])
        assert (r.returncode, r.success) == (126, False), r
        assert "nsbox: cannot start ls: Resource temporarily unavailable (the sandbox's process limit" in r.stderr
        await filler.kill()
        with anyio.fail_after(20):  # its children go with the sandbox's next breath
            while not (await sb.exec(["true"])).success:
                await sb.exec(["pkill", "-f", "import os, time"])
                await anyio.sleep(0.1)


def test_a_pids_limit_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="pids_limit must be at least 2 .the sandbox's init takes one."):
        nsbox.SandboxSpec(pids_limit=1)


# Spins for 1 s of wall time; prints the CPU time it got.
SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1: pass\nprint(time.process_time())"


@pytest.mark.timeout(30)
async def test_cpus(capfd: pytest.CaptureFixture[str]) -> None:
    async with nsbox.Sandbox(cpus=0.25) as sb:
        r = await sb.exec(["python3", "-c", SPIN])
        if by_cgroup("cpus"):
            _, parent = resources.support().cgroups["cpus"]
            quota = Path(parent) / f"nsbox-{sb.id}" / "cpu.cfs_quota_us"
            assert quota.read_text().strip() == "25000"
            assert float(r.stdout) < 0.5, r  # throttled to a quarter of a CPU
        else:
            assert "cpus is not enforced" in capfd.readouterr().err
    # More CPUs than the host has: no limit, and no quota past the kernel's
    # bound (a billion had failed the sandbox with EINVAL).
    async with nsbox.Sandbox(cpus=1e9) as sb:
        assert (await sb.exec(["true"])).success
        if by_cgroup("cpus"):
            _, parent = resources.support().cgroups["cpus"]
            quota = Path(parent) / f"nsbox-{sb.id}" / "cpu.cfs_quota_us"
            assert int(quota.read_text()) == (os.cpu_count() or 1) * 100000


@pytest.mark.timeout(30)
async def test_disk() -> None:
    async with nsbox.Sandbox(disk="16m") as sb:
        for path in ("/root/big", "/tmp/big", "/etc/big", "/dev/shm/big", "/run/big"):
            r = await sb.exec(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=32"])
            assert r.returncode != 0 and "No space left on device" in r.stderr, (path, r)
            await sb.exec(["rm", path])
        r = await sb.exec(["sh", "-c", "echo fine > /root/small && cat /root/small /etc/hostname"])
        assert r.stdout == f"fine\n{sb.hostname}\n", r
        # Nothing of it reached the host's disk.
        assert sb._layer is not None
        on_disk = sum(f.stat().st_size for f in sb._layer.rglob("*") if f.is_file() and not f.is_symlink())
        assert on_disk < 1 * MiB


def test_v2_delegated_cgroup(tmp_path: Path) -> None:
    """The cgroup v2 path, on a fake delegated cgroup (this host has no v2
    controllers): the files it writes."""
    parent = tmp_path / "user@1000.service" / "app.slice" / "scope"
    d = parent / "nsbox-abc"
    d.mkdir(parents=True)
    (parent / "cgroup.subtree_control").write_text("")
    for name in ("memory.max", "memory.swap.max", "pids.max", "cpu.max", "cgroup.procs"):
        (d / name).write_text("")
    limits = resources.ResourceLimits(memory=64 * MiB, pids_limit=10, cpus=1.5)
    run = tmp_path / "run"
    run.mkdir()
    resources.enter_cgroups(4242, limits, {k: ("v2", str(parent)) for k in ("memory", "pids_limit", "cpus")},
                            "abc", run)
    got = {f.name: f.read_text() for f in d.iterdir()}
    assert got == {"memory.max": str(64 * MiB), "memory.swap.max": "0", "pids.max": "10", "cpu.max": "150000 100000",
                   "cgroup.procs": "4242"}
    assert set((parent / "cgroup.subtree_control").read_text().split()) == {"+memory", "+pids", "+cpu"}
    assert (run / resources.CGROUPS_FILE).read_text() == f"{d}\n"


async def test_detached_sandbox_cgroups_go_with_nsbox_rm() -> None:
    from nsbox import manage
    from nsbox.host import live

    sb = await nsbox.Sandbox.create(pids_limit=50)
    info = await sb.detach()
    if by_cgroup("pids_limit"):
        assert leftover_cgroups(sb.id) != []
    manage.remove(info, force=True)
    assert leftover_cgroups(sb.id) == [] and not live.sandbox_dir(sb.id).exists()
