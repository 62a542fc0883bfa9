"""More live sandboxes in one process than its descriptor limit allows
descriptors: an idle sandbox holds no descriptor of its owner.

The scenario runs in a fresh interpreter (so the limit and the memory
figures are its own, and pytest's process is left alone): it lowers its
RLIMIT_NOFILE to a soft 128 and a hard 256, creates 300 sandboxes one
after the other, runs `echo` in each (25 at a time: nsbox must raise the
soft limit itself, nsbox.host.rlimits), waits until their control
connections have been idle long enough to be closed, measures, and closes
them all. A sandbox that kept even one descriptor open (its control
connection, its init's pidfd, an epoll) would make creation fail with
EMFILE before the 256th.

Reported (printed, visible with `pytest -s`, and written as JSON to
$NSBOX_SCALE_REPORT when set): creates, execs and closes per second,
descriptors per live sandbox, and memory per live sandbox: the inits' RSS
and PSS (from /proc/PID/smaps_rollup; PSS shares the static binary's pages
among them) and the growth of the host Python process.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest

from nsbox.host import dirs, live
from nsbox.host import layers as layer_store

N = 300
SOFT_LIMIT, HARD_LIMIT = 128, 256  # both below N
EXEC_CONCURRENCY = 25

SCENARIO = textwrap.dedent("""
    import json, os, resource, sys, time
    import anyio, psutil
    import nsbox
    from nsbox.create import zygote
    from nsbox.host import live, removal
    from nsbox.init import client, fdwait

    N, SOFT, hard, CONCURRENCY = map(int, sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))

    def memory(pid):
        '''(Rss, Pss) in KiB; Pss is None where smaps_rollup cannot be read.'''
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\\n")}
            return fields["Rss"], fields["Pss"]
        except (OSError, KeyError):
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None

    def fds():
        # Descriptors open, but for the idle epolls the process keeps for
        # its next execs (nsbox/init/fdwait.py: a few, whatever the count
        # of sandboxes).
        return len(os.listdir("/proc/self/fd")) - sum(map(len, fdwait.POLLERS._free.values()))

    def available_kib():
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))

    async def main():
        out = {"n": N, "soft_limit_at_start": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "hard_limit": hard}
        # One sandbox first: imports, the zygote and first-use caches are
        # then part of the baseline, not of the per-sandbox figures.
        async with nsbox.Sandbox() as sb:
            await sb.exec(["true"])
        out["soft_limit_after_first_sandbox"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        base_fds, base_mem, base_avail = fds(), memory("self"), available_kib()
        boxes, results = [], {}
        try:
            t = time.perf_counter()
            for _ in range(N):
                try:
                    boxes.append(await nsbox.Sandbox.create())
                except BaseException:
                    print(f"creating sandbox {len(boxes) + 1} of {N} failed", file=sys.stderr)
                    raise
            out["create_seconds"] = time.perf_counter() - t
            out["created"] = len(boxes)
            out["fds_per_sandbox"] = (fds() - base_fds) / N

            limiter = anyio.CapacityLimiter(CONCURRENCY)

            async def run(i):
                async with limiter:
                    results[i] = await boxes[i].exec(["echo", str(i)])

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(N):
                    tg.start_soon(run, i)
            out["exec_seconds"] = time.perf_counter() - t
            out["execs_ok"] = sum(results[i].success and results[i].stdout == f"{i}\\n" for i in range(N))
            out["fds_per_used_sandbox"] = (fds() - base_fds) / N  # connections not idle yet
            await anyio.sleep(client.IDLE_CLOSE + 0.5)
            out["fds_per_idle_sandbox"] = (fds() - base_fds) / N

            host_mem, avail = memory("self"), available_kib()
            out["inits"] = [[sb.pid, live.process_start_time(sb.pid)] for sb in boxes]
            out["ids"] = [sb.id for sb in boxes]
            init_mem = [memory(sb.pid) for sb in boxes]
            out["init_rss_kib_total"] = sum(rss for rss, _ in init_mem)
            pss = [p for _, p in init_mem]
            out["init_pss_kib_total"] = sum(pss) if None not in pss else None
            out["host_rss_growth_kib"] = host_mem[0] - base_mem[0]
            out["host_pss_growth_kib"] = (host_mem[1] - base_mem[1]) if base_mem[1] is not None else None
            out["meminfo_available_drop_kib"] = base_avail - avail
            zygote_pid = zygote.zygote_pid()
            out["zygote_rss_kib"] = memory(zygote_pid)[0] if zygote_pid else None
        finally:
            t = time.perf_counter()
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for sb in boxes:
                        tg.start_soon(sb.close)
            out["close_seconds"] = time.perf_counter() - t
        # The trash of the closed sandboxes' work dirs is swept on a thread
        # that holds a directory open while it works.
        out["swept"] = removal.wait_swept(60)
        out["fds_left_over"] = fds() - base_fds
        out["children_left"] = [c.pid for c in psutil.Process().children(recursive=True)
                                if c.pid not in zygote.helper_pids()]
        print(json.dumps(out), flush=True)

    anyio.run(main)
""")


def _fmt(kib: float) -> str:
    return f"{kib:.0f} KiB" if kib < 10 * 1024 else f"{kib / 1024:.1f} MiB"


@pytest.mark.timeout(300)
def test_more_live_sandboxes_than_descriptors(mode: str) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HARD_LIMIT:
        pytest.fail(f"the hard RLIMIT_NOFILE of this user is {hard}: the test needs {HARD_LIMIT}")
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(N), str(SOFT_LIMIT), str(HARD_LIMIT),
                           str(EXEC_CONCURRENCY)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"the scenario failed:\n{proc.stderr[-6000:]}"
    m = json.loads(proc.stdout.splitlines()[-1])

    report = {
        "mode": mode,
        "sandboxes": N,
        "soft_nofile_at_start": m["soft_limit_at_start"],
        "soft_nofile_after_first_sandbox": m["soft_limit_after_first_sandbox"],
        "hard_nofile": m["hard_limit"],
        "creates_per_second": N / m["create_seconds"],
        "execs_per_second": N / m["exec_seconds"],
        "closes_per_second": N / m["close_seconds"],
        "fds_per_live_sandbox": m["fds_per_sandbox"],
        "fds_per_used_sandbox": m["fds_per_used_sandbox"],
        "fds_per_idle_sandbox": m["fds_per_idle_sandbox"],
        "init_rss_kib_per_sandbox": m["init_rss_kib_total"] / N,
        "init_pss_kib_per_sandbox": None if m["init_pss_kib_total"] is None else m["init_pss_kib_total"] / N,
        "host_rss_growth_kib_per_sandbox": m["host_rss_growth_kib"] / N,
        "host_pss_growth_kib_per_sandbox": (None if m["host_pss_growth_kib"] is None
                                            else m["host_pss_growth_kib"] / N),
        "meminfo_available_drop_kib_per_sandbox": m["meminfo_available_drop_kib"] / N,
        "zygote_rss_kib": m["zygote_rss_kib"],
    }
    pss = report["init_pss_kib_per_sandbox"]
    host_pss = report["host_pss_growth_kib_per_sandbox"]
    print(f"\n[{mode}] {N} live sandboxes, soft NOFILE {report['soft_nofile_at_start']} -> "
          f"{report['soft_nofile_after_first_sandbox']} (hard {report['hard_nofile']}):\n"
          f"  {report['creates_per_second']:.0f} creates/s, {report['execs_per_second']:.0f} execs/s "
          f"({EXEC_CONCURRENCY} at a time), {report['closes_per_second']:.0f} closes/s\n"
          f"  per live sandbox: {report['fds_per_live_sandbox']:.2f} host fds once made, "
          f"{report['fds_per_used_sandbox']:.2f} just used, {report['fds_per_idle_sandbox']:.2f} idle; "
          f"init RSS {_fmt(report['init_rss_kib_per_sandbox'])}, "
          f"PSS {'n/a' if pss is None else _fmt(pss)}; "
          f"host Python +{_fmt(report['host_rss_growth_kib_per_sandbox'])} RSS, "
          f"+{'n/a' if host_pss is None else _fmt(host_pss)} PSS; "
          f"MemAvailable -{_fmt(report['meminfo_available_drop_kib_per_sandbox'])} (noisy; includes the kernel's)")
    if os.environ.get("NSBOX_SCALE_REPORT"):
        with open(os.environ["NSBOX_SCALE_REPORT"], "w") as f:
            json.dump(report, f, indent=1)

    assert m["soft_limit_at_start"] == SOFT_LIMIT
    assert m["created"] == N
    assert m["execs_ok"] == N
    assert m["soft_limit_after_first_sandbox"] == HARD_LIMIT  # raised by nsbox
    # A made sandbox holds nothing; a used one its connection until idle.
    assert m["fds_per_sandbox"] * N <= 2, "made sandboxes hold host descriptors"
    assert m["fds_per_idle_sandbox"] * N <= 2, "idle sandboxes hold host descriptors"
    # Everything closed: no descriptor, child, init, live entry or layer left.
    assert m["swept"], "the trash was not swept within 60 s"
    assert m["fds_left_over"] <= 0, f"{m['fds_left_over']} descriptors left open after closing"
    assert m["children_left"] == []
    alive = [pid for pid, start in m["inits"] if live.process_alive(pid, start)]
    assert alive == [], f"{len(alive)} nsbox-init processes still alive"
    assert len(set(m["ids"])) == N
    layers, run = layer_store.layers_dir(), dirs.runtime_dir()
    assert [i for i in m["ids"] if (layers / i).exists()] == []
    assert [i for i in m["ids"] if (run / i).exists() or live.read(i) is not None] == []
    pool = layers / layer_store.REUSE
    assert not pool.exists() or len(os.listdir(pool)) <= layer_store.REUSE_MAX
