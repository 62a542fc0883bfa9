#!/usr/bin/env python3
"""nsbox through the Inspect provider, as users run it, against baselines
measured in the same process.

Each row runs its variants interleaved (bench.py's `interleaved`) in
several rounds; a round's ratio is nsbox's median over the baseline's, and
the table shows the ratio's min/median/max over the rounds (the target is
checked on the median), with p10/median/p90 of every timing.

    python bench/provider.py                  # every row, default sizes
    python bench/provider.py --rows compose   # some rows: exec, output, sample, compose, live
    python bench/provider.py --full           # compose 100 samples at a time, 10,000 live sandboxes
    python bench/provider.py --check          # exit status 1 if a target is missed

bench.py runs the exec, output and sample rows in its own process (so in
every identity mode of bench/run.sh); `make bench` runs the compose and live
rows once, here. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import anyio

import nsbox
from timing import (BENCH_IMAGE, BWRAP_ARGS, OCI_LAYOUT, OCI_TAG, OUT_BYTES, Op, free_ports, interleaved, pct, proc_pss,
                    rusage_cpu, spawn_floor, stat_cpu, sync_op)

try:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

    from nsbox.inspect.provider import NsboxSandboxEnvironment as Provider
except ImportError:  # no Inspect: the rows say so
    LocalSandboxEnvironment = Provider = None  # type: ignore[assignment,misc]


# ---- measuring and the table -------------------------------------------

async def rounds(variants: dict[str, Op], n: int, warmup: int, count: int) -> dict[str, list[list[float]]]:
    """`count` rounds of `interleaved` (seconds per call, per round)."""
    out: dict[str, list[list[float]]] = {k: [] for k in variants}
    for _ in range(count):
        for k, v in (await interleaved(variants, n, warmup)).items():
            out[k].append(v)
    return out


def flat(per_round: list[list[float]]) -> list[float]:
    return [v for r in per_round for v in r]


@dataclass
class Row:
    operation: str
    nsbox: list[list[float]]  # per round (seconds, or a value per round)
    baseline: str
    base: list[list[float]] | None
    target: str
    check: Callable[["Row"], bool] | None = None
    unit: str = "ms"
    extra: str = ""  # shown after the result (p90 ratio, a difference)

    @property
    def n(self) -> str:
        return f"{len(self.nsbox[0])}x{len(self.nsbox)}" if self.nsbox and self.nsbox[0] else "0"

    def ratios(self) -> list[float]:
        if not self.base or not self.nsbox:
            return []
        return [statistics.median(a) / statistics.median(b) for a, b in zip(self.nsbox, self.base)]

    def ratio(self) -> float | None:
        r = self.ratios()
        return statistics.median(r) if r else None

    def ratio_at(self, q: float) -> float | None:
        """nsbox's q-quantile over the baseline's, all rounds pooled."""
        if not self.base:
            return None
        return pct(flat(self.nsbox), q) / pct(flat(self.base), q)

    @property
    def result(self) -> str:
        if self.check is None:
            return "-"
        if not self.nsbox or (self.base is not None and not self.ratios()):
            return "n/a"
        return "PASS" if self.check(self) else "FAIL"


def spread(per_round: list[list[float]] | None, unit: str) -> str:
    if not per_round or not per_round[0]:
        return "n/a"
    v = flat(per_round)
    if len(v) == 1 and unit != "ms":
        return f"{v[0]:.0f} {unit}" if v[0] == int(v[0]) else f"{num(v[0])} {unit}"
    scale = 1000 if unit == "ms" else 1
    return "/".join(num(x * scale) for x in (pct(v, 0.1), statistics.median(v), pct(v, 0.9))) + f" {unit}"


def num(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def print_table(title: str, rows: list[Row]) -> None:
    header = ["operation", "n", "nsbox p10/med/p90", "baseline", "baseline p10/med/p90",
              "ratio min/med/max", "target", "result"]
    lines = []
    for r in rows:
        ratios = r.ratios()
        ratio = "/".join(f"{x:.2f}" for x in (min(ratios), statistics.median(ratios), max(ratios))) + "x" \
            if ratios else "n/a" if r.base is not None else "-"
        lines.append([r.operation, r.n, spread(r.nsbox, r.unit), r.baseline, spread(r.base, r.unit), ratio,
                      r.target, r.result + (f" ({r.extra})" if r.extra else "")])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print("  ".join(c.rjust(w) if i in (1, 2, 4, 5) else c.ljust(w)
                        for i, (c, w) in enumerate(zip(line, widths))).rstrip())


def at_most(limit: float) -> Callable[[Row], bool]:
    return lambda r: (r.ratio() or 0) <= limit


# ---- exec, output, one sample's sandbox (bench.py runs these) ----------

async def quick_rows(n_exec: int, n_out: int, n_sample: int, count: int, notes: list[str]) -> list[Row]:
    """exec(["true"]), 10 MiB of output and one sample's sandbox, through
    the provider as Inspect calls it, beside the raw API and the baselines."""
    if Provider is None:
        return [Row("Inspect provider rows", [], "n/a: inspect_ai is not installed", None, "-")]
    await Provider.task_init("bench", None)
    envs = await Provider.sample_init("bench", None, {})
    local_envs = await LocalSandboxEnvironment.sample_init("bench", None, {})
    env, local = envs["default"], local_envs["default"]
    try:
        async with nsbox.Sandbox() as sb:
            def execs(cmd: list[str], size: int | None) -> dict[str, Op]:
                def op(target: Any) -> Op:
                    async def run() -> None:
                        r = await target.exec(cmd)
                        assert r.returncode == 0 and (size is None or len(r.stdout) == size), r.returncode
                    return run
                return {"provider": op(env), "local": op(local), "raw": op(sb)}

            ex = await rounds(execs(["true"], None), n_exec, 20, count)
            out = await rounds(execs(["head", "-c", str(OUT_BYTES), "/dev/zero"], OUT_BYTES), n_out, 3, count)
        samples = await bench_sample(n_sample, count)
    finally:
        await Provider.sample_cleanup("bench", None, envs, False)
        await Provider.task_cleanup("bench", None, True)
        await LocalSandboxEnvironment.sample_cleanup("bench", None, local_envs, False)
    true, mib = 'exec(["true"])', "exec 10 MiB stdout (head -c)"
    rows = [
        Row(f"{true}, provider", ex["provider"], "inspect local", ex["local"], "ratio <= 0.50", at_most(0.5)),
        Row(f"{true}, raw API", ex["raw"], "inspect local", ex["local"], "report"),
        Row(f"{true}, provider", ex["provider"], "raw API (its overhead)", ex["raw"], "report"),
        Row(f"{mib}, provider", out["provider"], "inspect local", out["local"], "ratio <= 0.25", at_most(0.25)),
        Row(f"{mib}, raw API", out["raw"], "inspect local", out["local"], "report"),
    ]
    # The command spawned from C, no sandbox (its stdout read into memory
    # for the 10 MiB row): for `true`, what no exec API can go below; for
    # 10 MiB, what a plain C program pays (how the reader and the writer
    # share the CPUs moves it either way).
    floors = {op: [[f] for _ in range(count) if (f := spawn_floor(n, cmd, capture)) is not None]
              for op, n, cmd, capture in ((true, n_exec, ["true"], False),
                                          (mib, n_out, ["head", "-c", str(OUT_BYTES), "/dev/zero"], True))}
    for op, base, local in ((true, ex["provider"], ex["local"]), (mib, out["provider"], out["local"])):
        if floors[op]:
            rows.append(Row(f"{op}, provider", base, "posix_spawn + waitpid from C", floors[op], "report"))
            floor, local_med = statistics.median(flat(floors[op])), statistics.median(flat(local))
            notes.append(f"{op}: spawned from C without a sandbox it takes {floor * 1000:.2f} ms, "
                         f"{floor / local_med:.2f}x of inspect local")
    return rows + sample_rows(samples, notes)


async def bench_sample(n: int, count: int) -> dict[str, list[list[float]]]:
    """One sample's sandbox: sample_init + exec true + sample_cleanup (the
    provider's task_init ran before), the raw API's `async with Sandbox()`
    + exec, and bubblewrap running `true`."""
    assert Provider is not None

    async def provider() -> None:
        envs = await Provider.sample_init("bench", None, {})
        try:
            assert (await envs["default"].exec(["true"])).success
        finally:
            await Provider.sample_cleanup("bench", None, envs, False)

    async def raw() -> None:
        async with nsbox.Sandbox() as sb:
            assert (await sb.exec(["true"])).success

    # How far making sandboxes ahead of the samples could go (nsbox does not:
    # a sample's sandbox is made when the sample asks): each sample takes the
    # one made while the previous sample ran, and starts making the next.
    ahead: list[asyncio.Task[nsbox.Sandbox]] = []

    async def made_ahead() -> None:
        sb = await (ahead.pop() if ahead else nsbox.Sandbox.create())
        ahead.append(asyncio.ensure_future(nsbox.Sandbox.create()))
        try:
            assert (await sb.exec(["true"])).success
        finally:
            await sb.close()

    async def drain() -> None:
        while ahead:
            await (await ahead.pop()).close()

    variants: dict[str, Op] = {"provider": provider, "raw": raw}
    bwrap = shutil.which("bwrap")
    if bwrap:
        variants["bwrap"] = sync_op([bwrap, *BWRAP_ARGS])
    out: dict[str, list[list[float]]] = {k: [] for k in (*variants, "ahead")}
    try:
        for _ in range(count):
            for k, v in (await interleaved(variants, n, 5)).items():
                out[k].append(v)
            # Alone, right after: round-robin would let the next sandbox be
            # made while the other variants are timed.
            out["ahead"].append((await interleaved({"ahead": made_ahead}, n, 5))["ahead"])
            await drain()
    finally:
        await drain()
    return out


def sample_rows(s: dict[str, list[list[float]]], notes: list[str]) -> list[Row]:
    op = "one sample: sample_init+exec true+cleanup"
    bwrap = s.get("bwrap")

    def goal(r: Row) -> bool:
        return (r.ratio() or 0) <= 0.7 and (r.ratio_at(0.9) or 0) <= 1.0

    provider = Row(f"{op}, provider", s["provider"], "bwrap --unshare-all ... true", bwrap,
                   "ratio <= 0.70, p90 <= 1.00", goal)
    raw = Row(f"{op}, raw API", s["raw"], "bwrap --unshare-all ... true", bwrap, "report")
    over = (statistics.median(flat(s["provider"])) - statistics.median(flat(s["raw"]))) * 1000
    for r in (provider, raw):
        r.extra = f"p90 ratio {r.ratio_at(0.9):.2f}x" if bwrap else ""
    notes.append(f"one sample: the provider adds {over:+.2f} ms (median) to the raw API's `async with Sandbox()` "
                 "+ exec; task_init ran once before the timing")
    ahead = Row(f"{op}, raw API, made ahead", s["ahead"], "bwrap --unshare-all ... true", bwrap, "report")
    ahead.extra = f"p90 ratio {ahead.ratio_at(0.9):.2f}x" if bwrap else ""
    notes.append("made ahead: the raw API's sample taking a sandbox made while the previous one ran (a pool "
                  "of one, which nsbox does not keep), timed alone right after each round: how far making "
                  "sandboxes early could go on this machine")
    return [provider, raw, ahead, Row(f"{op}, provider", s["provider"], "raw API (its overhead)", s["raw"],
                                      "report", extra=f"{over:+.2f} ms")]


# ---- compose samples, many at a time ---------------------------------------

PORT = 8000
HEALTH = "import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/', timeout=5).read()"
FETCH = "import urllib.request as u; assert b'Directory listing' in u.urlopen('http://{host}:{port}/', timeout=10).read()"
# The debian fixture has no python3: both services mount the host's /usr
# (Debian bookworm, as the fixture), so they run the python3 the bare
# baseline runs. NSBOX_COMPOSE_PATHS allows the bind (nsbox/compose/hostpaths.py).
COMPOSE = f"""\
services:
  default:
    image: {BENCH_IMAGE}
    command: sleep infinity
    volumes: ["/usr:/usr:ro"]
    depends_on:
      web:
        condition: service_healthy
  web:
    image: {BENCH_IMAGE}
    command: ["python3", "-m", "http.server", "{PORT}"]
    volumes: ["/usr:/usr:ro"]
    healthcheck:
      test: ["CMD", "python3", "-c", "{HEALTH.format(port=PORT)}"]
      interval: 1s
      timeout: 5s
      retries: 30
"""


def cpu_seconds(pid: int) -> float:
    """CPU time of the process itself, all its threads, not its reaped
    children (/proc/PID/schedstat: nanoseconds, unlike stat's ticks)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return total / 1e9


def reaped_cpu(pid: int) -> float:
    """CPU time of the children the process has reaped (cutime + cstime)."""
    try:
        return stat_cpu(pid)[1]
    except (OSError, IndexError, ValueError):
        return 0.0


def helpers() -> dict[tuple[int, float, str], float]:
    """nsbox's helper processes below this one -> CPU s. The network
    helper's and bridge workers' include what their reaped children used
    (pasta, per-request forks); the zygote's does not (its reaped children
    are sandboxes, services included)."""
    return {k: own + (0.0 if k[2] == "nsbox-create" else reaped) for k, (own, reaped) in helper_split().items()}


def helper_split() -> dict[tuple[int, float, str], tuple[float, float]]:
    """nsbox's helper processes below this one, not sandboxes: (pid, start,
    name) -> (own CPU s, CPU s of the children it reaped)."""
    import psutil  # the test extra's (`pip install -e '.[test]'`)

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if not is_sandboxed(p.pid):
                out[(p.pid, p.create_time(), p.name())] = (cpu_seconds(p.pid), reaped_cpu(p.pid))
        except psutil.Error:
            continue
    return out


def is_sandboxed(pid: int) -> bool:
    """Runs in another PID namespace than this process (a sandbox's)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    except OSError:
        return True


class LeakCheck:
    """What a row must not leave behind, of the sandboxes it made (`add`):
    their entries in the state directory (the live-sandbox entry, the
    layer), processes (this process's descendants, and any nsbox-init of
    theirs, orphans included), the network namespaces such processes hold,
    and descriptors of this process (a namespace held by one included). The zygote, id map holders and network helper live as long as
    this process, by design; other users of the machine do not count."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.rebase()

    def rebase(self) -> None:
        """Takes the state to compare with now (after a warm-up: the zygote,
        the network helper and their sockets come with first use)."""
        self.before = self.snapshot()
        self.before["state entries"] = set()  # none may remain, whenever made

    def add(self, sandbox: nsbox.Sandbox) -> None:
        self.ids.add(sandbox.id)

    def snapshot(self) -> dict[str, set[Any]]:
        import psutil

        from nsbox.create import zygote
        from nsbox.net import client

        keep = zygote.helper_pids() | ({client._default.pid} if client._default and client._default.pid else set())
        procs = set()
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid not in keep:
                    procs.add((p.pid, p.create_time(), p.name()))
            except psutil.Error:
                continue  # gone since it was listed
        for p in psutil.process_iter(["name", "cmdline"]):
            try:
                if p.info["name"] == "nsbox-init" and set(p.info["cmdline"][1:2]) & self.ids:
                    procs.add((p.pid, p.create_time(), "nsbox-init"))
            except (psutil.Error, TypeError):
                continue
        netns = set()
        for pid, _, _ in procs:
            try:
                netns.add(os.readlink(f"/proc/{pid}/ns/net"))
            except OSError:
                pass
        netns.discard(os.readlink("/proc/self/ns/net"))
        descriptors = {f"{fd} -> {target}" for fd, target in fd_targets().items()}
        return {"processes": procs, "network namespaces": netns, "state entries": self.state(),
                "descriptors of this process": descriptors}

    def grew(self, key: str, now: set[Any]) -> bool:
        """Descriptors count by number: nsbox keeps a spare set of pipes
        and sockets made ahead for the next exec, replaced as used."""
        return key != "descriptors of this process" or len(now) > len(self.before[key])

    def state(self) -> set[str]:
        from nsbox.host import layers, live

        paths = [p for i in self.ids for p in (live.sandbox_dir(i), layers.layers_dir() / i)]
        return {os.fspath(p) for p in paths if os.path.lexists(p)}

    async def left(self) -> list[str]:
        """What is there now that was not before (after closing the kept
        spare networks and waiting for the layers' removal)."""
        from nsbox.compose import services
        from nsbox.host import removal

        for net in services._spares.nets:  # kept for later samples by design
            await net.close()
        services._spares.nets.clear()
        await anyio.to_thread.run_sync(removal.wait_swept, 60)
        deadline = time.monotonic() + 10  # closed workers exit once they read their socket's end
        while True:
            after = self.snapshot()
            found = [f"{len(now - self.before[key])} {key} ({', '.join(sorted(map(str, now - self.before[key]))[:3])})"
                     for key, now in after.items() if now - self.before[key] and self.grew(key, now)]
            if not found or time.monotonic() > deadline:
                break
            await anyio.sleep(0.2)
        return found


async def ensure_image() -> None:
    """The debian fixture as BENCH_IMAGE in this user's store (as bench.py)."""
    from nsbox.sandbox import confined
    from nsbox.storage import Store
    from nsbox.storage.archive import import_image
    from nsbox.storage.resolve import resolve

    store = Store(runner=confined)
    try:
        await resolve(store, BENCH_IMAGE, pull="never")
    except Exception:
        await import_image(store, OCI_LAYOUT, name=BENCH_IMAGE, tag=OCI_TAG)


async def bench_compose(samples: int, count: int, notes: list[str]) -> list[Row]:
    """`samples` compose samples at once through the provider (web server
    with a healthcheck, a client fetching from it by name), against the
    same processes run bare on the host, `samples` at once."""
    op = f"compose: {samples} samples at once, provider"
    if Provider is None or not os.path.isfile(os.path.join(OCI_LAYOUT, "index.json")):
        return [Row(op, [], "n/a: inspect_ai or the OCI fixture (rootfs/images.sh) missing", None, "-")]
    from nsbox.compose.services import FAST_PROBE

    await ensure_image()
    os.environ["NSBOX_COMPOSE_PATHS"] = os.pathsep.join(filter(None, (os.environ.get("NSBOX_COMPOSE_PATHS"), "/usr")))
    leaks = LeakCheck()
    work = tempfile.mkdtemp(prefix="nsbox-bench-compose-")
    path = os.path.join(work, "compose.yaml")
    with open(path, "w") as f:
        f.write(COMPOSE)
    cpu: dict[str, list[float]] = {"host process": [], "helpers": [], "inits": []}
    probes: list[int] = []
    by_helper: dict[str, float] = {}  # helper name -> CPU s per sample, summed over batches
    python3 = "/usr/bin/python3"  # the binary the services run (the host's /usr), not PATH's
    # As in the sandboxes: no proxy between the client and its server.
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}

    async def nsbox_batch() -> None:
        inits = 0.0

        async def sample(i: int) -> None:
            nonlocal inits
            envs = await Provider.sample_init("bench", path, {"__sample_id__": str(i)})
            for e in envs.values():
                leaks.add(e.as_type(Provider).sandbox)
            try:
                # At once, no retry: sample_init returned after web's healthcheck passed.
                r = await envs["default"].exec(["python3", "-c", FETCH.format(host="web", port=PORT)])
                assert r.success, r.stderr
                inits += sum(cpu_seconds(e.as_type(Provider).sandbox.pid) for e in envs.values())
            finally:
                await Provider.sample_cleanup("bench", path, envs, False)

        before, helpers0 = rusage_cpu(resource.RUSAGE_SELF), helpers()
        async with anyio.create_task_group() as tg:
            for i in range(samples):
                tg.start_soon(sample, i)
        cpu["host process"].append((rusage_cpu(resource.RUSAGE_SELF) - before) / samples)
        for k, v in helpers().items():
            by_helper[k[2]] = by_helper.get(k[2], 0.0) + (v - helpers0.get(k, 0.0)) / samples
        cpu["helpers"].append(sum(by_helper.values()) - sum(cpu["helpers"]))
        cpu["inits"].append(inits / samples)

    async def bare_batch() -> None:
        async def sample(port: int) -> None:
            server = await anyio.open_process([python3, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work, env=env)
            try:
                delay, tries = FAST_PROBE, 0
                while True:  # the provider's probe schedule (nsbox/compose/services.py)
                    tries += 1
                    probe = [python3, "-c", HEALTH.format(port=port)]
                    if (await anyio.run_process(probe, check=False, env=env)).returncode == 0:
                        break
                    assert server.returncode is None and tries < 100, "the bare server did not come up"
                    await anyio.sleep(delay)
                    delay = min(delay * 1.5, 1.0)
                probes.append(tries)
                await anyio.run_process([python3, "-c", FETCH.format(host="127.0.0.1", port=port)], env=env)
            finally:
                server.terminate()
                await server.wait()

        async with anyio.create_task_group() as tg:
            for port in free_ports(samples):  # distinct: a server whose port another took exits at once
                tg.start_soon(sample, port)

    try:
        await Provider.task_init("bench", path)
        # sample_init returns once web's healthcheck passed (the fetch in
        # each timed sample, made at once, depends on it).
        envs = await Provider.sample_init("bench", path, {})
        for e in envs.values():
            leaks.add(e.as_type(Provider).sandbox)
        services = envs["default"].as_type(Provider)._services
        assert services is not None
        healthy, shape = set(services.services._healthy), services.services.network
        await Provider.sample_cleanup("bench", path, envs, False)
        assert healthy == {"web"}, f"the provider did not wait for web's healthcheck: healthy {healthy}"
        notes.append(f"compose: sample_init waited for web's healthcheck (its Services marked it healthy); "
                     f"network shape {shape!r}")
        # One sample of each outside the timing (the images' first use).
        await rounds({"nsbox": nsbox_batch, "bare": bare_batch}, 1, 0, 1)
        leaks.rebase()
        for v in cpu.values():
            v.clear()
        probes.clear()
        by_helper.clear()
        s = await rounds({"nsbox": nsbox_batch, "bare": bare_batch}, 1, 0, count)
    finally:
        await Provider.task_cleanup("bench", path, True)
        shutil.rmtree(work, ignore_errors=True)
    left = await leaks.left()
    per = [sum(parts) for parts in zip(*cpu.values())]
    notes.append(f"compose: nsbox's CPU per sample (median of {count} batches): this process "
                 f"{statistics.median(cpu['host process']) * 1000:.1f} ms + helpers "
                 f"{statistics.median(cpu['helpers']) * 1000:.1f} ms + the services' nsbox-inits "
                 f"{statistics.median(cpu['inits']) * 1000:.1f} ms (their own CPU until the fetch; the services' "
                 f"processes, probes and the fetch not counted; helpers by name, mean: "
                 + ", ".join(f"{k} {v / count * 1000:.1f} ms" for k, v in sorted(by_helper.items(), key=lambda kv: -kv[1]))
                 + "); bare probes until healthy: median "
                 f"{statistics.median(probes) if probes else 0:.0f}")
    notes.append("compose: left behind after the row: " + ("; ".join(left) if left else "nothing"))
    return [
        Row(f"compose: {samples} samples at once (wall), provider", s["nsbox"], f"bare processes, {samples} at once",
            s["bare"], "ratio <= 1.10", at_most(1.10)),
        Row(f"compose: nsbox CPU per sample ({samples} at once)", [[v] for v in per], "(no baseline)", None,
            "<= 10 ms", lambda r: statistics.median(flat(r.nsbox)) <= 0.010),
        Row(f"compose: nothing left of {len(leaks.ids)} sandboxes", [[float(len(left))]], "(no baseline)", None,
            "0 left", lambda r: not left, unit="found"),
    ]


# ---- live sandboxes in one process -----------------------------------------

def rss_kib(pid: int | str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def available_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))


def fd_targets() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def bench_live(count: int, notes: list[str]) -> list[Row]:
    """Creates `count` sandboxes one after another and holds them, idle."""
    from nsbox.host import removal

    leaks = LeakCheck()
    soft0, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with nsbox.Sandbox() as sb:  # imports, the zygote, caches: part of the base
        await sb.exec(["true"])
    await anyio.to_thread.run_sync(removal.wait_swept, 60)
    leaks.rebase()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    base_fds, base_rss, base_avail = fds(), rss_kib("self"), available_kib()
    base_fd_set = fd_targets()
    boxes: list[nsbox.Sandbox] = []
    error = ""
    t = time.perf_counter()
    try:
        for _ in range(count):
            try:
                boxes.append(await nsbox.Sandbox.create())
                leaks.add(boxes[-1])
            except Exception as e:  # reported, as the row's outcome
                error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                break
        created_s = time.perf_counter() - t
        made = len(boxes)
        host_kib = rss_kib("self") - base_rss
        avail_drop = base_avail - available_kib()
        fd_per = (fds() - base_fds) / max(made, 1)
        pss = [proc_pss(sb.pid) for sb in boxes]
        pss_total = sum(p for p in pss if p is not None)
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for sb in boxes:
                    tg.start_soon(sb.close)
    await anyio.to_thread.run_sync(removal.wait_swept, 120)
    fds_left = fds() - base_fds
    new_fds = sorted(set(fd_targets().items()) - set(base_fd_set.items()))
    left = await leaks.left()
    per_kib = (host_kib + pss_total) / max(made, 1)
    outcome = f"sandbox {count} created" if made == count else f"sandbox {made + 1} failed: {error}"
    notes.append(f"live sandboxes: {made} of {count} in {created_s:.1f} s; {outcome}; RLIMIT_NOFILE soft "
                 f"{soft0} at start, {soft} after the first sandbox (nsbox raises it), hard {hard}")
    notes.append(f"live sandboxes: memory per sandbox = (this process's RSS growth {host_kib} KiB + the inits' "
                 f"PSS {pss_total} KiB) / {made} (the zygote and other helpers not counted); descriptors per idle "
                 f"sandbox = growth of /proc/self/fd / {made}; MemAvailable fell by {avail_drop / max(made, 1):.0f} KiB "
                 f"per sandbox (kernel memory included, and whatever else this machine ran meanwhile)")
    notes.append(f"live sandboxes: after closing, {fds_left:+d} descriptors"
                 + (f" (new: {', '.join(f'{fd} -> {t}' for fd, t in new_fds[:5])})" if new_fds else "")
                 + f"; left behind: {'; '.join(left) if left else 'nothing'}")
    rows = [
        Row(f"live sandboxes: memory per sandbox ({made})", [[per_kib]], "(no baseline)", None, "< 400 KiB",
            lambda r: flat(r.nsbox)[0] < 400, unit="KiB"),
        Row(f"live sandboxes: host descriptors per idle sandbox ({made})", [[fd_per]], "(no baseline)", None,
            "0", lambda r: flat(r.nsbox)[0] <= 0, unit="fds"),
        Row(f"live sandboxes: the {count}th create", [[float(made)]], "(no baseline)", None, "succeeds",
            lambda r: made == count, unit="made", extra=outcome if made < count else ""),
        Row("live sandboxes: nothing left after closing", [[float(len(left) + (fds_left > 0))]], "(no baseline)",
            None, "0 left", lambda r: not left and fds_left <= 0, unit="found"),
    ]
    return rows


# ---- main ------------------------------------------------------------------

ROWS = ("exec", "output", "sample", "compose", "live")


async def amain(args: argparse.Namespace) -> int:
    chosen = args.rows.split(",") if args.rows else list(ROWS)
    unknown = set(chosen) - set(ROWS)
    if unknown:
        print(f"unknown rows: {', '.join(sorted(unknown))} (choose from {', '.join(ROWS)})", file=sys.stderr)
        return 2
    compose_n = args.compose_samples or (100 if args.full else 20)
    live_n = args.live or (10000 if args.full else 1000)
    notes: list[str] = []
    rows: list[Row] = []
    t = time.perf_counter()
    if {"exec", "output", "sample"} & set(chosen):
        quick = await quick_rows(max(3, round(200 * args.scale)), max(3, round(40 * args.scale)),
                                 max(3, round(60 * args.scale)), args.rounds, notes)
        keep = {"exec": "exec([", "output": "exec 10 MiB", "sample": "one sample"}
        rows += [r for r in quick if any(r.operation.startswith(keep[c]) for c in chosen if c in keep)]
    if "compose" in chosen:
        rows += await bench_compose(compose_n, args.rounds, notes)
    if "live" in chosen:
        rows += await bench_live(live_n, notes)
    print_table(f"Inspect provider path ({args.rounds} rounds; the machine's load shows in the spread)", rows)
    for note in notes:
        print("  " + note)
    print(f"  total time {time.perf_counter() - t:.1f} s")
    failed = [r for r in rows if r.result == "FAIL"]
    if failed:
        print(f"targets missed: {', '.join(r.operation + ' vs ' + r.baseline for r in failed)}")
    return 1 if failed and args.check else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help=f"comma-separated, of {', '.join(ROWS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per row (default 3)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the exec/output/sample counts")
    parser.add_argument("--full", action="store_true", help="compose 100 samples at a time, 10,000 live sandboxes")
    parser.add_argument("--compose-samples", type=int, help="compose samples at a time (default 20, --full 100)")
    parser.add_argument("--live", type=int, help="live sandboxes to hold (default 1,000, --full 10,000)")
    parser.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")
    sys.exit(anyio.run(amain, parser.parse_args()))


if __name__ == "__main__":
    main()
