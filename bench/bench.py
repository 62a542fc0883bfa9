#!/usr/bin/env python3
"""nsbox micro-benchmarks against baselines measured in the same run.

Prints one table (one line per operation and baseline) with medians, the
ratio nsbox/baseline and a PASS/FAIL against the target. Each operation's
variants are interleaved (one sample of each in turn, order alternating) so
that drift in machine load hits every variant alike.

    python bench/bench.py            # report; exit status 0
    python bench/bench.py --check    # exit status 1 if a target is missed
    python bench/bench.py --scale 0.2  # fewer iterations (a quick look)

See bench/README.md for what is measured and why.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anyio

import nsbox

try:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment
except ImportError:  # the table says "n/a" for the Inspect rows
    LocalSandboxEnvironment = None  # type: ignore[assignment,misc]

MiB = 1024 * 1024
OUT_BYTES = 10 * MiB
FILE_BYTES = 50 * MiB
RSS_SANDBOXES = 10
BWRAP_ARGS = [
    "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev", "true",
]
UNSHARE_CMD = ["unshare", "-Urmpf", "--mount-proc", "true"]

Op = Callable[[], Awaitable[Any]]


# ---- measuring ---------------------------------------------------------

async def interleaved(variants: dict[str, Op], n: int, warmup: int) -> dict[str, list[float]]:
    """Times n calls of each variant (seconds), round-robin, after a warm-up.

    The order within a round alternates so no variant always runs right
    after another one's cleanup.
    """
    for _ in range(warmup):
        for op in variants.values():
            await op()
    gc.collect()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    items = list(variants.items())
    for i in range(n):
        for name, op in (items if i % 2 == 0 else items[::-1]):
            t0 = time.perf_counter()
            await op()
            samples[name].append(time.perf_counter() - t0)
    return samples


def sync_op(cmd: list[str]) -> Op:
    """An op timing a whole subprocess.run (run on the loop's thread)."""
    async def op() -> None:
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    return op


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---- the table -----------------------------------------------------------

@dataclass
class Row:
    operation: str
    n: int
    nsbox: float | None
    baseline: str
    base: float | None
    unit: str  # "ms" or "KiB"
    target: str  # shown as is
    check: Callable[[float, float], bool] | None = None  # (nsbox, ratio) -> ok
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.nsbox is None or not self.base:
            return None
        return self.nsbox / self.base

    @property
    def result(self) -> str:
        if self.check is None:
            return "-"
        if self.nsbox is None or self.ratio is None:
            return "n/a"
        return "PASS" if self.check(self.nsbox, self.ratio) else "FAIL"


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "ms":
        ms = value * 1000
        return f"{ms:.3f} ms" if ms < 10 else f"{ms:.2f} ms" if ms < 100 else f"{ms:.1f} ms"
    return f"{value:.0f} {unit}"


def print_table(rows: list[Row]) -> None:
    header = ["operation", "n", "nsbox median", "baseline", "baseline median", "ratio", "target", "result"]
    lines = [[r.operation, str(r.n), fmt(r.nsbox, r.unit), r.baseline, fmt(r.base, r.unit),
              "n/a" if r.ratio is None else f"{r.ratio:.2f}x", r.target, r.result] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    right = {1, 2, 4, 5}

    def render(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    print(render(header))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print(render(line))


def ms_spread(samples: list[float]) -> str:
    return f"p10 {pct(samples, 0.1) * 1000:.3f} / p90 {pct(samples, 0.9) * 1000:.3f} ms"


# ---- the benchmarks ------------------------------------------------------

async def bench_exec_true(sb: nsbox.Sandbox, local: Any, n: int, warmup: int, notes: list[str]) -> list[Row]:
    async def ns() -> None:
        r = await sb.exec(["true"])
        assert r.returncode == 0, r

    async def insp() -> None:
        r = await local.exec(["true"])
        assert r.returncode == 0, r

    async def insp_nc() -> None:
        r = await local.exec(["true"], concurrency=False)
        assert r.returncode == 0, r

    async def plain() -> None:
        r = await anyio.run_process(["true"])
        assert r.returncode == 0

    variants: dict[str, Op] = {"nsbox": ns, "anyio.run_process": plain}
    if local is not None:
        variants["inspect local"] = insp
        variants["inspect local (concurrency=False)"] = insp_nc
    s = await interleaved(variants, n, warmup)
    med = {k: statistics.median(v) for k, v in s.items()}
    notes.append("exec true: " + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    op = 'exec(["true"])'
    return [
        Row(op, n, med["nsbox"], "inspect local", med.get("inspect local"), "ms", "ratio <= 0.70",
            lambda _v, r: r <= 0.70),
        Row(op, n, med["nsbox"], "inspect local (concurrency=False)",
            med.get("inspect local (concurrency=False)"), "ms", "report"),
        Row(op, n, med["nsbox"], "anyio.run_process", med["anyio.run_process"], "ms", "report"),
    ]


async def bench_create(n: int, warmup: int, notes: list[str]) -> list[Row]:
    parts: dict[str, list[float]] = {"create": [], "close": []}

    async def ns() -> None:
        t0 = time.perf_counter()
        sb = await nsbox.Sandbox.create()
        t1 = time.perf_counter()
        await sb.close()
        parts["create"].append(t1 - t0)
        parts["close"].append(time.perf_counter() - t1)

    variants: dict[str, Op] = {"nsbox": ns, "unshare -Urmpf true": sync_op(UNSHARE_CMD)}
    bwrap = shutil.which("bwrap")
    if bwrap:
        variants["bwrap true"] = sync_op([bwrap, *BWRAP_ARGS])
    s = await interleaved(variants, n, warmup)
    # The warm-up calls also recorded their parts; keep the measured ones.
    for k in parts:
        parts[k] = parts[k][warmup:]
    med = {k: statistics.median(v) for k, v in s.items()}
    notes.append(f"create+destroy: nsbox create {statistics.median(parts['create']) * 1000:.2f} ms + "
                 f"close {statistics.median(parts['close']) * 1000:.2f} ms (medians), this process's RSS "
                 f"{proc_status(os.getpid()).get('VmRSS', 0) // 1024} MiB; "
                 + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    op = "create+destroy"
    rows = [Row(op, n, med["nsbox"], "unshare -Urmpf --mount-proc true", med["unshare -Urmpf true"], "ms", "report")]
    rows.append(Row(op, n, med["nsbox"], "bwrap --unshare-all ... true", med.get("bwrap true"), "ms",
                    "ratio <= 1.00", lambda _v, r: r <= 1.0))
    return rows


async def bench_output(sb: nsbox.Sandbox, local: Any, n: int, warmup: int, notes: list[str]) -> list[Row]:
    cmd = ["head", "-c", str(OUT_BYTES), "/dev/zero"]

    async def ns() -> None:
        r = await sb.exec(cmd)
        assert r.returncode == 0 and len(r.stdout) == OUT_BYTES, (r.returncode, len(r.stdout))

    async def insp() -> None:
        r = await local.exec(cmd)
        assert r.returncode == 0 and len(r.stdout) == OUT_BYTES, (r.returncode, len(r.stdout))

    variants: dict[str, Op] = {"nsbox": ns}
    if local is not None:
        variants["inspect local"] = insp
    s = await interleaved(variants, n, warmup)
    med = {k: statistics.median(v) for k, v in s.items()}
    notes.append("exec 10 MiB stdout: " + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    return [Row("exec 10 MiB stdout (head -c)", n, med["nsbox"], "inspect local", med.get("inspect local"),
                "ms", "ratio <= 0.50", lambda _v, r: r <= 0.50)]


async def bench_files(sb: nsbox.Sandbox, local: Any, n: int, warmup: int, notes: list[str]) -> list[Row]:
    data = os.urandom(FILE_BYTES)
    name = "bench-50m.bin"  # relative: the sandbox's workdir / Inspect's temporary directory

    async def ns_write() -> None:
        await sb.write_file(name, data)

    async def ns_read() -> None:
        got = await sb.read_file(name, text=False)
        assert len(got) == FILE_BYTES

    async def insp_write() -> None:
        await local.write_file(name, data)

    async def insp_read() -> None:
        got = await local.read_file(name, text=False)
        assert len(got) == FILE_BYTES

    # Correctness once, outside the timing.
    await ns_write()
    assert await sb.read_file(name, text=False) == data
    if local is not None:
        await insp_write()
        assert await local.read_file(name, text=False) == data

    variants: dict[str, Op] = {"nsbox write": ns_write, "nsbox read": ns_read}
    if local is not None:
        variants["inspect write"] = insp_write
        variants["inspect read"] = insp_read
    s = await interleaved(variants, n, warmup)
    med = {k: statistics.median(v) for k, v in s.items()}
    mbps = {k: FILE_BYTES / MiB / v for k, v in med.items()}
    notes.append("50 MiB files: " + "; ".join(f"{k} {v:.0f} MiB/s" for k, v in mbps.items()))
    await sb.exec(["rm", "-f", name])
    return [
        Row("write_file 50 MiB", n, med["nsbox write"], "inspect local", med.get("inspect write"), "ms", "report"),
        Row("read_file 50 MiB", n, med["nsbox read"], "inspect local", med.get("inspect read"), "ms", "report"),
    ]


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0])
    return out


def proc_pss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


async def bench_rss(count: int, notes: list[str]) -> list[Row]:
    sandboxes = []
    try:
        for _ in range(count):
            sandboxes.append(await nsbox.Sandbox.create())
        for sb in sandboxes:  # used once, then idle
            assert (await sb.exec(["true"])).success
        await anyio.sleep(0.2)
        stats = [proc_status(sb.pid) for sb in sandboxes]
        pss = [p for p in (proc_pss(sb.pid) for sb in sandboxes) if p is not None]
    finally:
        for sb in sandboxes:
            await sb.close()

    sleeps = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    try:
        for p in sleeps:  # wait until each one is sleep, not our forked child
            for _ in range(1000):
                with open(f"/proc/{p.pid}/comm") as f:
                    if f.read().strip() == "sleep":
                        break
                time.sleep(0.001)
        await anyio.sleep(0.2)
        sleep_stats = [proc_status(p.pid) for p in sleeps]
        sleep_pss = [v for v in (proc_pss(p.pid) for p in sleeps) if v is not None]
    finally:
        for p in sleeps:
            p.kill()
            p.wait()

    def med(values: list[dict[str, int]], key: str) -> float:
        return statistics.median(v.get(key, 0) for v in values)

    notes.append(
        f"idle RSS: nsbox-init VmRSS {med(stats, 'VmRSS'):.0f} KiB = RssAnon {med(stats, 'RssAnon'):.0f} "
        f"+ RssFile {med(stats, 'RssFile'):.0f} (shared page cache of the static binary) KiB, "
        f"Pss {statistics.median(pss) if pss else float('nan'):.0f} KiB, VmPTE {med(stats, 'VmPTE'):.0f} KiB; "
        f"sleep VmRSS {med(sleep_stats, 'VmRSS'):.0f} KiB, RssAnon {med(sleep_stats, 'RssAnon'):.0f} KiB, "
        f"Pss {statistics.median(sleep_pss) if sleep_pss else float('nan'):.0f} KiB")
    return [Row("idle RSS per sandbox (init VmRSS)", count, med(stats, "VmRSS"), "sleep process",
                med(sleep_stats, "VmRSS"), "KiB", "< 1024 KiB", lambda v, _r: v < 1024)]


# ---- main ----------------------------------------------------------------

def machine() -> list[str]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import importlib.metadata as md
        inspect_version = md.version("inspect_ai")
    except Exception:
        inspect_version = "not installed"
    try:
        bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        bwrap = "bwrap not installed"
    return [
        f"kernel {platform.release()} ({platform.machine()}), cpus {os.cpu_count()} "
        f"(usable {len(os.sched_getaffinity(0))}), {model}",
        f"python {platform.python_version()}, nsbox {nsbox.__version__}, inspect_ai {inspect_version}, "
        f"{bwrap}, uid {os.geteuid()}",
    ]


async def amain(args: argparse.Namespace) -> int:
    def iters(base: int) -> int:
        return max(3, round(base * args.scale))

    n_exec, n_create, n_out, n_file = iters(200), iters(50), iters(20), iters(10)
    for line in machine():
        print(line)
    print(f"iterations: exec {n_exec}, create+destroy {n_create}, 10 MiB exec {n_out}, "
          f"50 MiB files {n_file}, RSS {RSS_SANDBOXES} sandboxes; medians after a warm-up, variants interleaved")
    t_start = time.perf_counter()
    rows: list[Row] = []
    notes: list[str] = []

    local = None
    envs = None
    if LocalSandboxEnvironment is not None:
        envs = await LocalSandboxEnvironment.sample_init("bench", None, {})
        local = envs["default"]
    try:
        async with nsbox.Sandbox() as sb:
            notes.append(f"sandbox: idmap {sb.idmap.mode if sb.idmap else '?'}, rootfs {sb.rootfs}, "
                         f"workdir {sb.workdir}; event loop {type(asyncio.get_running_loop()).__name__}")
            rows += await bench_exec_true(sb, local, n_exec, 20, notes)
            rows += await bench_output(sb, local, n_out, 3, notes)
            rows += await bench_files(sb, local, n_file, 2, notes)
        rows += await bench_create(n_create, 5, notes)
        rows += await bench_rss(RSS_SANDBOXES, notes)
    finally:
        if envs is not None:
            await LocalSandboxEnvironment.sample_cleanup("bench", None, envs, False)

    print()
    print_table(rows)
    print()
    for note in notes:
        print("  " + note)
    print(f"  total time {time.perf_counter() - t_start:.1f} s")
    failed = [r for r in rows if r.result == "FAIL"]
    if failed:
        print(f"targets missed: {', '.join(f'{r.operation} vs {r.baseline}' for r in failed)}")
    return 1 if failed and args.check else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts (default 1)")
    args = parser.parse_args()
    sys.exit(anyio.run(amain, args))


if __name__ == "__main__":
    main()
