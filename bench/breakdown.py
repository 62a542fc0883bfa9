#!/usr/bin/env python3
"""Where the time of an exec and of a sample's sandbox goes, through the
Inspect provider (docs/performance.md holds the figures and what they say).

    python bench/breakdown.py             # both tables
    python bench/breakdown.py --top 25    # and the host's hottest functions (cProfile)
    python bench/breakdown.py --compose 20 --execs 0 --samples 0   # a compose sample's steps
    python bench/breakdown.py --networks 30 --execs 0 --samples 0  # what a service network costs

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

With --compose N, N compose samples of bench/provider.py's compose row run
one after another, and the CPU of this process's main thread is split by
the step of nsbox it ran in (each step inclusive of the steps it awaits in
the same task; the services are made and started in tasks of their own).

CPU times come from the kernel's accounting in clock ticks (usually 10 ms),
summed over hundreds of operations. A 2-core machine runs the host and the
sandbox side at once, so the wall time is less than the CPU sum.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import inspect
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import time
from typing import Any, Awaitable, Callable

import anyio

from nsbox.create import zygote
from timing import BWRAP_ARGS, proc_pss, rusage_cpu, stat_cpu

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


class Steps:
    """This thread's CPU while each instrumented function of nsbox runs
    (a coroutine: while one of its steps runs), counted once when nested."""

    def __init__(self) -> None:
        self.cpu: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._depth: collections.Counter[str] = collections.Counter()
        self._wrapped: list[tuple[Any, str, Any]] = []

    def timed(self, key: str, step: Callable[..., Any], *args: Any) -> Any:
        outer = self._depth[key] == 0
        self._depth[key] += 1
        t0 = time.thread_time()
        try:
            return step(*args)
        finally:
            self._depth[key] -= 1
            if outer:
                self.cpu[key] += time.thread_time() - t0

    def wrap(self, owner: Any, name: str) -> None:
        orig, key = getattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name}"
        steps = self

        class Timed:  # the coroutine, each step of it timed
            def __init__(self, coro: Any) -> None:
                self.coro = coro

            def __await__(self) -> "Timed":
                return self

            def __next__(self) -> Any:
                return self.send(None)

            def send(self, value: Any) -> Any:
                return steps.timed(key, self.coro.send, value)

            def throw(self, *exc: Any) -> Any:
                return steps.timed(key, self.coro.throw, *exc)

            def close(self) -> None:
                self.coro.close()

        @functools.wraps(orig)
        def wrapper(*a: Any, **k: Any) -> Any:
            self.calls[key] += 1
            if inspect.iscoroutinefunction(orig):
                return Timed(orig(*a, **k))
            return self.timed(key, functools.partial(orig, *a, **k))

        self._wrapped.append((owner, name, orig))
        setattr(owner, name, wrapper)

    def unwrap(self) -> None:
        for owner, name, orig in reversed(self._wrapped):
            setattr(owner, name, orig)
        self._wrapped.clear()


async def compose_steps(n: int) -> None:
    """Where this process's CPU goes in a compose sample (bench/provider.py's)."""
    import tempfile

    import provider as row
    from nsbox import sandbox
    from nsbox.compose.services import Services
    from nsbox.create import layer, netattach, procedure
    from nsbox.init import users

    if not os.path.isfile(os.path.join(row.OCI_LAYOUT, "index.json")):
        print("\ncompose: skipped, the OCI fixture is missing (bash rootfs/images.sh makes it)")
        return
    steps = Steps()
    for owner, name in [
            (Provider, "sample_init"), (Provider, "sample_cleanup"), (Services, "_create"),
            (Services, "_run_command"), (Services, "_wait_ready"), (Services, "close"),
            (sandbox.Sandbox, "_use_image"), (sandbox.Sandbox, "_create"), (sandbox.Sandbox, "_settle_identity"),
            (sandbox.Sandbox, "exec"), (sandbox.Sandbox, "close"), (procedure, "launch"), (procedure, "register"),
            (layer, "prepare"), (netattach.NetAttachment, "reserve"), (netattach.NetAttachment, "_join"),
            (netattach.NetAttachment, "start"), (netattach.NetAttachment, "_write_as_root"),
            (users, "identity_files")]:
        steps.wrap(owner, name)
    await row.ensure_image()
    os.environ["NSBOX_COMPOSE_PATHS"] = os.pathsep.join(filter(None, (os.environ.get("NSBOX_COMPOSE_PATHS"), "/usr")))
    work = tempfile.mkdtemp(prefix="nsbox-breakdown-")
    path = os.path.join(work, "compose.yaml")
    with open(path, "w") as f:
        f.write(row.COMPOSE)
    thread = process = 0.0
    try:
        await Provider.task_init("profile", path)
        for i in range(n + 3):  # the first three: the image's first use
            if i == 3:
                steps.cpu.clear()
                steps.calls.clear()
                t0, c0, helpers0 = time.thread_time(), rusage_cpu(resource.RUSAGE_SELF), row.helper_split()
            envs = await Provider.sample_init("profile", path, {"__sample_id__": str(i)})
            r = await envs["default"].exec(["python3", "-c", row.FETCH.format(host="web", port=row.PORT)])
            assert r.success, r.stderr
            await Provider.sample_cleanup("profile", path, envs, False)
        thread, process = time.thread_time() - t0, rusage_cpu(resource.RUSAGE_SELF) - c0
        helpers = {k: (own - helpers0[k][0], reaped - helpers0[k][1])
                   for k, (own, reaped) in row.helper_split().items() if k in helpers0}
    finally:
        steps.unwrap()  # the rows after this one time nsbox itself
        await Provider.task_cleanup("profile", path, True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\na compose sample (2 services, web's healthcheck, one fetch), x{n}, one at a time: CPU of this process "
          f"{process / n * 1e3:.2f} ms, of it the main thread {thread / n * 1e3:.2f} ms")
    print(f"  {'ms':>7} {'calls':>6}  step (main thread, inclusive)")
    for key, cpu in steps.cpu.most_common():
        print(f"  {cpu / n * 1e3:7.2f} {steps.calls[key] / n:6.1f}  {key}")
    print("  nsbox's helper processes, CPU per sample: own, and of the children they reaped (pasta, slirp4netns)")
    for (pid, _, name), (own, reaped) in sorted(helpers.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {own / n * 1e3:7.2f} {reaped / n * 1e3:7.2f}  {name} ({pid})")


async def network_costs(n: int) -> None:
    """What a service network costs: made and closed `n` times one after
    another (wall, and CPU by process), then `n` made at once (wall) and
    held (the host's MemAvailable, and the bridge workers' PSS)."""
    import nsbox
    import provider as row

    warm = nsbox.Network("breakdown-warm", internal=True)  # the helper and its first import
    await warm.start()
    try:
        helpers0, c0, t0 = row.helper_split(), time.process_time(), time.perf_counter()
        for i in range(n):
            net = nsbox.Network(f"breakdown-{i}", internal=True)
            await net.start()
            await net.close()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        await anyio.sleep(0.5)  # the last worker reaped
        print(f"\na service network made and closed, x{n}, one after another: wall {wall / n * 1e3:.2f} ms, "
              f"CPU of this process {cpu / n * 1e3:.2f} ms")
        for key, (own, reaped) in row.helper_split().items():
            if key in helpers0 and key[2] != "nsbox-bridge":  # the network helper (the warm network's worker idles)
                (pid, _, name), (own0, reaped0) = key, helpers0[key]
                print(f"  {name} ({pid}): own {(own - own0) / n * 1e3:.2f} ms, of the children it reaped "
                      f"(the workers) {(reaped - reaped0) / n * 1e3:.2f} ms")
        before, held = row.available_kib(), [nsbox.Network(f"breakdown-held-{i}", internal=True) for i in range(n)]
        try:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:  # as samples starting together make theirs
                for net in held:
                    tg.start_soon(net.start)
            print(f"  {n} made at once: {(time.perf_counter() - t0) * 1e3:.0f} ms until the last was ready")
            await anyio.sleep(1)
            fell = (before - row.available_kib()) / n
            workers = [p for (p, _, name) in row.helper_split() if name == "nsbox-bridge"]
            print(f"  held {n} at once: MemAvailable fell by {fell:.0f} KiB each; the bridge workers' PSS "
                  f"{statistics.mean(proc_pss(p) or 0 for p in workers):.0f} KiB each ({len(workers)} workers)")
        finally:
            for net in held:
                await net.close()
    finally:
        await warm.close()


async def amain(args: argparse.Namespace) -> None:
    if Provider is None:
        raise SystemExit("bench/breakdown.py needs inspect_ai (pip install 'nsbox[inspect]')")
    if args.networks > 0:
        await network_costs(args.networks)
    if args.compose > 0:
        await compose_steps(args.compose)
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
    p.add_argument("--compose", type=int, default=0, help="also split N compose samples by step")
    p.add_argument("--networks", type=int, default=0, help="also make and close N service networks, then hold N")
    p.add_argument("--top", type=int, default=0, help="also print the host's N hottest functions (cProfile)")
    anyio.run(amain, p.parse_args())


if __name__ == "__main__":
    main()
