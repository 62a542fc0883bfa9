"""What bench.py and provider.py share: the baselines' command lines, the
fixture image, and how variants are timed (interleaved, in one process)."""

from __future__ import annotations

import atexit
import functools
import gc
import os
import resource
import shutil
import socket
import subprocess
import tempfile
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
TICK = os.sysconf("SC_CLK_TCK")


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
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports of 127.0.0.1 (all held until all are
    chosen: ports picked one at a time may repeat)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def stat_cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of `pid`, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / TICK, (cutime + cstime) / TICK


def rusage_cpu(who: int) -> float:
    """User + system CPU seconds of getrusage(`who`)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


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


# The cost of running a command at all, no sandbox: posix_spawn + waitpid in
# a loop, from C, timed per call (median, seconds); with its stdout read to
# the end into memory when asked. For `true`, any exec API pays at least
# this; for captured output, it is what a plain C program pays (how reader
# and writer share the CPUs moves it either way).
SPAWN_FLOOR_C = r"""
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
extern char **environ;
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    int n = atoi(argv[1]), capture = atoi(argv[2]);
    double *t = malloc(sizeof *t * n);
    size_t cap = 1 << 20, len;
    char *buf = malloc(cap);
    for (int i = 0; i < n; i++) {
        struct timespec a, b;
        posix_spawn_file_actions_t fa;
        int p[2], st;
        pid_t pid;
        clock_gettime(CLOCK_MONOTONIC, &a);
        posix_spawn_file_actions_init(&fa);
        if (capture) {
            if (pipe(p)) return 1;
            posix_spawn_file_actions_adddup2(&fa, p[1], 1);
            posix_spawn_file_actions_addclose(&fa, p[0]);
            posix_spawn_file_actions_addclose(&fa, p[1]);
        }
        if (posix_spawnp(&pid, argv[3], &fa, NULL, argv + 3, environ)) return 1;
        posix_spawn_file_actions_destroy(&fa);
        if (capture) {
            ssize_t r;
            close(p[1]);
            len = 0;
            while ((r = read(p[0], buf + len, cap - len)) > 0)
                if ((len += r) == cap && !(buf = realloc(buf, cap *= 2))) return 1;
            close(p[0]);
        }
        if (waitpid(pid, &st, 0) != pid) return 1;
        clock_gettime(CLOCK_MONOTONIC, &b);
        t[i] = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
    }
    qsort(t, n, sizeof *t, cmp);
    printf("%.9f\n", t[n / 2]);
    return 0;
}
"""


@functools.cache
def _floor_program() -> str | None:
    """SPAWN_FLOOR_C compiled, once per process (removed at exit); None
    without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = tempfile.mkdtemp(prefix="nsbox-bench-floor-")
    atexit.register(shutil.rmtree, d, True)
    src, exe = os.path.join(d, "floor.c"), os.path.join(d, "floor")
    with open(src, "w") as f:
        f.write(SPAWN_FLOOR_C)
    return exe if subprocess.run([cc, "-O2", "-o", exe, src], capture_output=True).returncode == 0 else None


def spawn_floor(n: int, cmd: list[str], capture: bool = False) -> float | None:
    """Median seconds of one posix_spawn + waitpid of `cmd` from C (its
    stdout read into memory if `capture`); None without a C compiler."""
    exe = _floor_program()
    if exe is None:
        return None
    r = subprocess.run([exe, str(max(n, 1)), str(int(capture)), *cmd], capture_output=True, text=True)
    return float(r.stdout) if r.returncode == 0 else None
