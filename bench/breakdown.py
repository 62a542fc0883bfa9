#!/usr/bin/env python3
"""Where the time of an exec and of a sample's sandbox goes, through the
Inspect provider (docs/performance.md holds the figures and what they say).

    python bench/breakdown.py             # both tables
    python bench/breakdown.py --top 25    # and the host's hottest functions (cProfile)

For each operation, run N times in a row: wall time per operation, and CPU
time per operation split by process:

- host: this process (Python: the provider, nsbox, asyncio), from
  getrusage(RUSAGE_SELF);
- init: the sandbox's nsbox-init, from /proc/PID/stat (utime+stime);
- commands: what the init reaped (the commands and the helpers that start
  them), /proc/PID/stat cutime+cstime of the init;
- sandboxes: whole sandboxes this process reaped (their init and all they
  ran), RUSAGE_CHILDREN;
- zygote: nsbox-create (the zygote and its holders), which clones each
  sandbox; the setup of a sandbox up to the exec of its init runs in the
  clone, a child of this process: it counts in "sandboxes";
- helpers: the other processes nsbox started (network helpers).

CPU times come from the kernel's accounting in clock ticks (usually 10 ms),
summed over hundreds of operations. A 2-core machine runs the host and the
sandbox side at once, so the wall time is less than the CPU sum.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import shutil
import subprocess
import time
from typing import Any, Awaitable, Callable

import anyio

from nsbox.create import zygote
from timing import BWRAP_ARGS, rusage_cpu, stat_cpu

try:
    from nsbox.inspect.provider import NsboxSandboxEnvironment as Provider
except ImportError:  # no Inspect
    Provider = None  # type: ignore[assignment,misc]

def tree_cpu(root: int, skip: set[int]) -> float:
    """CPU seconds of `root`'s descendants (not `skip`), alive now."""
    total = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == root:
            own, reaped = stat_cpu(int(name))
            total += own + reaped + tree_cpu(int(name), skip)
    return total


class Split:
    """CPU of each part, between start() and stop()."""

    def __init__(self, init: int | None = None) -> None:
        self.init = init

    def read(self) -> dict[str, float]:
        out = {"host": rusage_cpu(resource.RUSAGE_SELF), "sandboxes": rusage_cpu(resource.RUSAGE_CHILDREN)}
        zygotes = zygote.helper_pids()  # the zygote and its holders
        out["zygote"] = sum(sum(stat_cpu(z)) for z in zygotes)
        if self.init:
            out["init"], out["commands"] = stat_cpu(self.init)
        out["helpers"] = tree_cpu(os.getpid(), zygotes | ({self.init} if self.init else set()))
        return out

    def start(self) -> None:
        self.t0, self.before = time.perf_counter(), self.read()

    def stop(self, n: int) -> dict[str, float]:
        wall, after = time.perf_counter() - self.t0, self.read()
        out = {k: (after[k] - self.before.get(k, 0.0)) / n for k in after}
        out["helpers"] = max(0.0, out["helpers"])
        out["wall"] = wall / n
        return out


def show(title: str, unit: str, scale: float, parts: dict[str, float], order: list[str]) -> None:
    cpu = sum(parts.get(k, 0.0) for k in order)
    print(f"\n{title}")
    print(f"  {'part':<10} {unit:>10}  share of CPU")
    for k in order:
        if k in parts:
            print(f"  {k:<10} {parts[k] * scale:10.3f}  {parts[k] / cpu * 100 if cpu else 0:5.1f} %")
    print(f"  {'CPU sum':<10} {cpu * scale:10.3f}")
    print(f"  {'wall':<10} {parts['wall'] * scale:10.3f}")


async def profiled(fn: Callable[[], Awaitable[Any]], n: int, top: int) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        await fn()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


async def amain(args: argparse.Namespace) -> None:
    if Provider is None:
        raise SystemExit("bench/breakdown.py needs inspect_ai (pip install 'nsbox[inspect]')")
    await Provider.task_init("profile", None)
    envs = await Provider.sample_init("profile", None, {})
    env = envs["default"]
    try:
        async def exec_true() -> None:
            await env.exec(["true"])

        if args.execs > 0:
            for _ in range(100):
                await exec_true()
            split = Split(env.sandbox.pid)
            split.start()
            for _ in range(args.execs):
                await exec_true()
            parts = split.stop(args.execs)
            show(f"exec(['true']) through the provider, x{args.execs}", "us", 1e6, parts,
                 ["host", "init", "commands"])
            if args.top:
                await profiled(exec_true, args.execs // 2, args.top)
    finally:
        await Provider.sample_cleanup("profile", None, envs, False)

    async def sample() -> None:
        e = await Provider.sample_init("profile", None, {})
        await e["default"].exec(["true"])
        await Provider.sample_cleanup("profile", None, e, False)

    if args.samples <= 0:
        await Provider.task_cleanup("profile", None, True)
        return
    for _ in range(20):
        await sample()
    split = Split()
    split.start()
    for _ in range(args.samples):
        await sample()
    parts = split.stop(args.samples)
    show(f"a sample's sandbox (sample_init + exec(['true']) + sample_cleanup), x{args.samples}", "ms", 1e3,
         parts, ["host", "zygote", "sandboxes", "helpers"])
    if args.top:
        await profiled(sample, args.samples // 2, args.top)
    await Provider.task_cleanup("profile", None, True)
    bwrap = shutil.which("bwrap")
    if bwrap:
        # The sample row's baseline, accounted alike: what a sample costs in
        # CPU bounds how fast samples can come on this many cores, however
        # much of a sandbox were made ahead of the sample.
        cmd = [bwrap, *BWRAP_ARGS]
        for _ in range(20):
            subprocess.run(cmd, check=True)
        split = Split()
        split.start()
        for _ in range(args.samples):
            subprocess.run(cmd, check=True)
        parts = split.stop(args.samples)
        show(f"bubblewrap running true (the sample row's baseline), x{args.samples}", "ms", 1e3, parts,
             ["host", "sandboxes"])
        print(f"  (host: this process starting it; sandboxes: bwrap and true; {os.cpu_count()} cores)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--execs", type=int, default=2000)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--top", type=int, default=0, help="also print the host's N hottest functions (cProfile)")
    anyio.run(amain, p.parse_args())


if __name__ == "__main__":
    main()
