#!/usr/bin/env python3
"""How long a line written inside a sandbox takes to reach the host as an event.

A command in the sandbox writes N lines, each carrying the CLOCK_MONOTONIC
time at which it was written (the sandbox shares the host's clock: nsbox
creates no time namespace), sleeping between writes. The host notes the
clock when each event arrives; the delay of a line is the difference.

    python bench/exec_remote.py                 # 200 lines, 10 ms apart
    python bench/exec_remote.py -n 500 --interval 0.002
    python bench/exec_remote.py --polling       # add Inspect's polling fallback

Rows:
  nsbox Process         Sandbox.start_process, iterated directly
  Inspect exec_remote   the provider's native exec_remote, called through
                        Inspect's SandboxEnvironmentProxy as a sample would
  polling fallback      (--polling) Inspect's default exec_remote: its tool
                        server injected into the sandbox and polled; 8 lines,
                        1 s apart (a poll that finds nothing sleeps 5 s)

Target: median and p95 under 5 ms for the native rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any, AsyncIterator

import anyio

import nsbox
from nsbox.init.streaming import Exit, Output

TARGET_MS = 5.0

WRITER = """
import os, sys, time
n, interval = int(sys.argv[1]), float(sys.argv[2])
for i in range(n):
    os.write(1, b"%d %d\\n" % (i, time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
    time.sleep(interval)
"""


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


async def delays(chunks: AsyncIterator[bytes]) -> list[float]:
    """Delay (ms) of every line, measured when the chunk holding it arrived."""
    out: list[float] = []
    pending = b""
    async for data in chunks:
        arrived = now_ns()
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            _, written = line.split()
            out.append((arrived - int(written)) / 1e6)
    return out


def writer_cmd(n: int, interval: float) -> list[str]:
    return ["python3", "-c", WRITER, str(n), str(interval)]


async def nsbox_process(sb: nsbox.Sandbox, n: int, interval: float) -> list[float]:
    proc = await sb.start_process(writer_cmd(n, interval))

    async def chunks() -> AsyncIterator[bytes]:
        async for event in proc:
            if isinstance(event, Output) and event.stream == "stdout":
                yield event.data
            elif isinstance(event, Exit) and event.returncode != 0:
                raise RuntimeError(f"the writer exited with {event.returncode}")

    return await delays(chunks())


async def inspect_chunks(proc: Any) -> AsyncIterator[bytes]:
    from inspect_ai.util import ExecCompleted, ExecStdout

    async for event in proc:
        if isinstance(event, ExecStdout):
            yield event.data.encode()
        elif isinstance(event, ExecCompleted) and event.exit_code != 0:
            raise RuntimeError(f"the writer exited with {event.exit_code}")


async def inspect_native(env: Any, n: int, interval: float) -> list[float]:
    return await delays(inspect_chunks(await env.exec_remote(writer_cmd(n, interval))))


async def inspect_polling(env: Any, n: int, interval: float) -> list[float]:
    from inspect_ai.util import SandboxEnvironment

    # The base class's implementation, as every provider without a native one gets.
    proc = await SandboxEnvironment.exec_remote(env, writer_cmd(n, interval))
    return await delays(inspect_chunks(proc))


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def row(name: str, values: list[float] | str, native: bool) -> str:
    if isinstance(values, str):
        return f"{name:<22} {'':>6} {values}"
    med, p95 = statistics.median(values), pct(values, 95)
    verdict = ("PASS" if med < TARGET_MS and p95 < TARGET_MS else "FAIL") if native else "report"
    return (f"{name:<22} {len(values):>6} {med:>9.3f} {p95:>9.3f} {max(values):>9.3f} {min(values):>9.3f}"
            f"   {'< 5 ms' if native else '-':<7} {verdict}")


async def main(args: argparse.Namespace) -> None:
    print(f"nsbox exec_remote latency: write in the sandbox -> event on the host "
          f"({args.n} lines, {args.interval * 1000:g} ms apart)")
    print(f"host: {platform.node()} {platform.release()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"uid {os.getuid()}")
    print(f"{'variant':<22} {'lines':>6} {'median ms':>9} {'p95 ms':>9} {'max ms':>9} {'min ms':>9}   "
          f"{'target':<7} result")
    results: list[tuple[str, list[float] | str, bool]] = []
    async with nsbox.Sandbox() as sb:
        await sb.exec(["python3", "-c", "pass"])  # warm the page cache
        results.append(("nsbox Process", await nsbox_process(sb, args.n, args.interval), True))
        print(row(*results[-1]))
    try:
        from inspect_ai.util._sandbox.events import SandboxEnvironmentProxy

        from nsbox.inspect.config import NsboxConfig
        from nsbox.inspect.provider import NsboxSandboxEnvironment
    except ImportError:
        print(row("Inspect exec_remote", "n/a (inspect_ai is not installed)", True))
        return
    cfg = NsboxConfig()
    envs = await NsboxSandboxEnvironment.sample_init("bench", cfg, {})
    try:
        env = SandboxEnvironmentProxy(envs["default"])
        print(row("Inspect exec_remote", await inspect_native(env, args.n, args.interval), True))
        if args.polling:
            try:
                values: list[float] | str = await inspect_polling(env, 8, args.polling_interval)
            except Exception as e:  # the tool server could not be injected here
                values = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
            print(row("polling fallback", values, False))
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("bench", cfg, envs, False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=200, help="lines to write (default 200)")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between lines (default 0.01)")
    parser.add_argument("--polling", action="store_true", help="also measure Inspect's polling fallback")
    parser.add_argument("--polling-interval", type=float, default=1.0,
                        help="seconds between the polling fallback's 8 lines (default 1: an agent's pace)")
    anyio.run(main, parser.parse_args())
