"""What bench.py and provider.py share: the baselines' command lines, the
fixture image, and how variants are timed (interleaved, in one process)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import time
from typing import Any, Awaitable, Callable

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
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The debian fixture as an OCI image (rootfs/images.sh, run by `make bench`).
OCI_LAYOUT = os.path.join(REPO, "rootfs", "build", "oci")
OCI_TAG = "debian"
BENCH_IMAGE = "nsbox-bench/debian:12"  # kept in this user's image store between runs
PODMAN_PUBLISHED = (0.200, 0.280)  # `podman run --rm IMG true`, published figures (s)

Op = Callable[[], Awaitable[Any]]


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_pss(pid: int | str) -> int | None:
    """The proportional set size of `pid` in KiB (None if unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
