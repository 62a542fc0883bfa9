#!/usr/bin/env python3
"""What each network mode adds to creating (and closing) a real sandbox,
service network members included (target: within 2 ms of none).

Creates and closes nsbox.Sandbox() on the host-composed root in each mode,
interleaved (one of each in turn, order alternating) so that drift in load
hits every mode alike, after a warm-up that starts the network thread and
its helper process (once per process). Prints medians and p90s, and the
added cost over "none". nat is skipped (and says why) where /dev/net/tun
is not usable.

    python bench/netmodes.py [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

import nsbox
from nsbox.net import usernet

MODES: list[tuple[str, dict[str, object]]] = [
    ("none", {"network": "none"}),
    ("proxy", {"network": "proxy", "allow": ["example.com"]}),
    ("nat", {"network": "nat"}),
    ("none + 1 published port", {"network": "none", "ports": ["0:8000"]}),
]


async def main(runs: int) -> None:
    modes = list(MODES)
    try:
        usernet.check_tun()
        tool = usernet.find_tool()[0]
    except nsbox.NsboxError as e:
        print(f"nat skipped: {e}")
        modes = [m for m in modes if m[0] != "nat"]
        tool = None
    # Service network members: the network exists already (made once), as
    # it does for every member but the first.
    internal = await nsbox.Network("bench-internal", internal=True).start()
    modes.append(("service network (internal)", {"network": internal}))
    outbound = None
    if tool:
        outbound = await nsbox.Network("bench-outbound").start()
        modes.append(("service network (outbound)", {"network": outbound}))
    create: dict[str, list[float]] = {name: [] for name, _ in modes}
    close: dict[str, list[float]] = {name: [] for name, _ in modes}
    for name, options in modes:  # warm-up
        async with nsbox.Sandbox(**options):  # type: ignore[arg-type]
            pass
    for i in range(runs):
        for name, options in (modes if i % 2 == 0 else modes[::-1]):
            t0 = time.perf_counter()
            sb = await nsbox.Sandbox(**options).start()  # type: ignore[arg-type]
            t1 = time.perf_counter()
            await sb.close()
            t2 = time.perf_counter()
            create[name].append((t1 - t0) * 1000)
            close[name].append((t2 - t1) * 1000)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    def p90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    await internal.close()
    if outbound is not None:
        await outbound.close()
    base = med(create["none"])
    print(f"sandbox create/close by network mode, {runs} runs each (ms){f'; nat uses {tool}' if tool else ''}")
    print(f"{'mode':<26}{'create med':>11}{'p90':>8}{'added':>8}{'close med':>11}{'p90':>8}")
    for name, _ in modes:
        print(f"{name:<26}{med(create[name]):>11.2f}{p90(create[name]):>8.2f}{med(create[name]) - base:>+8.2f}"
              f"{med(close[name]):>11.2f}{p90(close[name]):>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    anyio.run(main, parser.parse_args().runs)
