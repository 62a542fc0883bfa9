#!/usr/bin/env python3
"""nsbox micro-benchmarks against baselines measured in the same run.

Prints one table (one line per operation and baseline) with medians, the
ratio nsbox/baseline and a PASS/FAIL against the target. Each operation's
variants are interleaved (one sample of each in turn, order alternating) so
that drift in machine load hits every variant alike.

    python bench/bench.py            # report; exit status 0
    python bench/bench.py --check    # exit status 1 if a target is missed
    python bench/bench.py --scale 0.2  # fewer iterations (a quick look)

A second table (bench/provider.py) runs the same operations through the
Inspect provider, as Inspect calls it, in rounds. See bench/README.md and
docs/benchmarks.md for what is measured and why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import anyio

import nsbox
from nsbox.create.unshare import remove_layer

try:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment
except ImportError:  # the table says "n/a" for the Inspect rows
    LocalSandboxEnvironment = None  # type: ignore[assignment,misc]

from timing import (  # noqa: E402  (bench/timing.py: what bench.py and provider.py share)
    MiB,
    OUT_BYTES,
    FILE_BYTES,
    RSS_SANDBOXES,
    BWRAP_ARGS,
    UNSHARE_CMD,
    OCI_LAYOUT,
    OCI_TAG,
    BENCH_IMAGE,
    PODMAN_PUBLISHED,
    Op,
    interleaved,
    spawn_floor,
    sync_op,
    pct,
    free_port,
    proc_pss,
)


def create_close(**options: Any) -> Op:
    """An op creating a sandbox with `options` and closing it."""
    async def op() -> None:
        sb = await nsbox.Sandbox.create(**options)
        await sb.close()
    return op


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
    floor = spawn_floor(n, ["true"])
    notes.append("exec true: " + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    if floor is not None and med.get("inspect local"):
        notes.append(f"exec true: 0.70x Inspect local is {0.7 * med['inspect local'] * 1000:.3f} ms; "
                     f"posix_spawn + waitpid alone, from C, takes {floor * 1000:.3f} ms")
    op = 'exec(["true"])'
    return [
        Row(op, n, med["nsbox"], "posix_spawn + waitpid of true, from C (the floor)", floor, "ms", "report"),
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


class DirtyWriter:
    """A process that keeps writing a file (no fsync) on the filesystem of
    nsbox's writable layers, so that the host always has dirty pages there,
    as a host running other jobs does."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / ".bench-dirty"
        self.proc = subprocess.Popen(
            ["sh", "-c", 'while :; do dd if=/dev/zero of="$1" bs=1M count=256 status=none; done', "sh",
             os.fspath(self.path)], stdin=subprocess.DEVNULL, start_new_session=True)

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.path.unlink(missing_ok=True)


async def bench_create_writeback(n: int, warmup: int, notes: list[str]) -> list[Row]:
    """create+destroy while another process writes to the disk that holds
    the layers: an overlay unmount that syncs its upper filesystem (without
    `volatile`) waits for all of that writeback."""
    op = "create+destroy, host writing to the layers' disk"
    variants: dict[str, Op] = {"nsbox": create_close()}
    bwrap = shutil.which("bwrap")
    if bwrap:
        variants["bwrap true"] = sync_op([bwrap, *BWRAP_ARGS])
    from nsbox.host import dirs

    writer = DirtyWriter(dirs.data_dir())
    try:
        s = await interleaved(variants, n, warmup)
    finally:
        writer.close()
    med = {k: statistics.median(v) for k, v in s.items()}
    notes.append("create+destroy under writeback: " + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    return [Row(op, n, med["nsbox"], "bwrap --unshare-all ... true (no overlay)", med.get("bwrap true"), "ms",
                "report")]


async def bench_limits(n: int, warmup: int, notes: list[str]) -> list[Row]:
    """What resource limits add to create+destroy (a cgroup where the host
    delegates one, else rlimits and a capped tmpfs: see `nsbox doctor`)."""
    limits = {"memory": "256m", "pids_limit": 256, "cpus": 1.0}
    s = await interleaved({"limits": create_close(**limits), "plain": create_close()}, n, warmup)
    med = {k: statistics.median(v) for k, v in s.items()}
    from nsbox.plan import resources

    how = resources.support()
    notes.append(f"limits (cgroup {how.cgroup}, enforced by a cgroup: {', '.join(sorted(how.enforced)) or 'none'}): "
                 + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    return [Row("create+destroy, memory+pids+cpus limits", n, med["limits"], "the same without limits",
                med["plain"], "ms", "report")]


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


async def bench_image_create(n: int, warmup: int, notes: list[str]) -> list[Row]:
    """create + exec true + close from a cached image, interleaved with the
    same on the host root (and `podman run --rm` when installed)."""
    op = "image: create+exec true+destroy"
    podman = tool("podman")
    podman_text = "podman run --rm IMG true" if podman else (
        f"podman (not installed): published {PODMAN_PUBLISHED[0] * 1000:.0f}-{PODMAN_PUBLISHED[1] * 1000:.0f} ms, "
        "low end")
    if not os.path.isfile(os.path.join(OCI_LAYOUT, "index.json")):
        why = f"n/a: {OCI_LAYOUT} missing (rootfs/images.sh)"
        return [Row(op, 0, None, f"host rootfs ({why})", None, "ms", "<= +1 ms vs host"),
                Row(op, 0, None, podman_text, None, "ms", "report")]
    from nsbox.sandbox import confined
    from nsbox.storage import Store
    from nsbox.storage.archive import import_image
    from nsbox.storage.resolve import resolve

    store = Store(runner=confined)
    try:
        await resolve(store, BENCH_IMAGE, pull="never")
    except Exception:  # not there yet, or not unpacked: import the layout
        await import_image(store, OCI_LAYOUT, name=BENCH_IMAGE, tag=OCI_TAG)
    parts: dict[str, list[float]] = {}

    def timed(kind: str, **options: Any) -> Op:
        async def run() -> None:
            t0 = time.perf_counter()
            sb = await nsbox.Sandbox.create(**options)
            t1 = time.perf_counter()
            r = await sb.exec(["true"])
            assert r.returncode == 0, r
            t2 = time.perf_counter()
            await sb.close()
            for part, v in (("create", t1 - t0), ("exec", t2 - t1), ("close", time.perf_counter() - t2)):
                parts.setdefault(f"{kind} {part}", []).append(v)
        return run

    variants: dict[str, Op] = {"image": timed("image", image=BENCH_IMAGE), "host": timed("host")}
    podman_ref = ""
    if podman:
        # podman's own store: copied in once, outside the timing.
        podman_ref = "localhost/nsbox-bench-debian:12"
        r = subprocess.run([podman, "pull", "-q", f"oci:{OCI_LAYOUT}:{OCI_TAG}"], capture_output=True, text=True)
        if r.returncode == 0:
            subprocess.run([podman, "tag", r.stdout.strip().splitlines()[-1], podman_ref], capture_output=True)
            variants["podman"] = sync_op([podman, "run", "--rm", "--network", "none", podman_ref, "true"])
        else:
            podman_text = f"podman run --rm (pull failed: {r.stderr.strip()[-80:]})"
    s = await interleaved(variants, n, warmup)
    for k in parts:
        parts[k] = parts[k][warmup:]
    med = {k: statistics.median(v) for k, v in s.items()}
    diff = med["image"] - med["host"]
    notes.append("image create+exec+destroy: " + ", ".join(
        f"{k} {statistics.median(v) * 1000:.2f}" for k, v in parts.items()) + " ms (medians); "
        + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    base_podman = med.get("podman", PODMAN_PUBLISHED[0] if not podman else None)
    return [
        Row(op, n, med["image"], "same on the host rootfs", med["host"], "ms", f"<= +1 ms ({diff * 1000:+.2f} ms)",
            lambda _v, _r: diff <= 0.001),
        Row(op, n, med["image"], podman_text, base_podman, "ms", "report"),
    ]


COMPOSE_PUBLISHED = 1.5  # `docker compose up -d --wait` + `down` of 2 cached services, low end (s)


async def bench_compose(n: int, warmup: int, notes: list[str]) -> list[Row]:
    """A 2-service compose sample (the default service depends on the
    other) brought up and torn down as the Inspect provider does per
    sample, images cached, against two plain image sandboxes; and the same
    two services on an internal network, each in a network namespace of
    its own (Docker's shape), against the pod mode (network_mode none)."""
    op = "compose: 2-service sample up+down"
    if not os.path.isfile(os.path.join(OCI_LAYOUT, "index.json")):
        return [Row(op, 0, None, f"n/a: {OCI_LAYOUT} missing (rootfs/images.sh)", None, "ms", "report")]
    import tempfile

    from nsbox.inspect.compose import prepare, start_sample

    service = f"    image: {BENCH_IMAGE}\n    command: sleep infinity\n"
    pod = (f"services:\n  default:\n{service}    network_mode: none\n    depends_on: [web]\n"
           f"  web:\n{service}    network_mode: none\n")
    per_service = (f"services:\n  default:\n{service}    networks: [back]\n    depends_on: [web]\n"
                   f"  web:\n{service}    networks: [back]\nnetworks:\n  back:\n    internal: true\n")
    with tempfile.TemporaryDirectory() as d:
        tasks = []
        for name, text in (("pod", pod), ("per-service", per_service)):
            path = os.path.join(d, f"{name}.yaml")
            with open(path, "w") as f:
                f.write(text)
            tasks.append(await prepare(path))

        def up_down(task: Any) -> Op:
            async def sample() -> None:
                s, _ = await start_sample(task, "bench")
                await s.close()
            return sample

        async def two() -> None:
            a = await nsbox.Sandbox.create(image=BENCH_IMAGE)
            b = await nsbox.Sandbox.create(image=BENCH_IMAGE)
            await b.close()
            await a.close()

        s = await interleaved({"compose": up_down(tasks[0]), "per-service": up_down(tasks[1]), "two": two}, n, warmup)
    med = {k: statistics.median(v) for k, v in s.items()}
    notes.append("compose sample: " + "; ".join(f"{k} {ms_spread(v)}" for k, v in s.items()))
    diff = med["per-service"] - med["compose"]
    return [Row(op, n, med["compose"], "2 image sandboxes create+destroy", med["two"], "ms", "report"),
            Row(op, n, med["compose"], "docker compose up --wait + down (published, low end)", COMPOSE_PUBLISHED,
                "ms", "ratio <= 0.05", lambda _v, r: r <= 0.05),
            Row("compose: 2 services, a namespace each", n, med["per-service"], "the pod mode (row above)",
                med["compose"], "ms", f"<= +2 ms ({diff * 1000:+.2f} ms)", lambda _v, _r: diff <= 0.002)]


class LoopbackRegistry:
    """Debian's docker-registry on 127.0.0.1:<free port> (as tests/imagekit.py)."""

    def __init__(self, binary: str, workdir: str) -> None:
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = os.path.join(workdir, "config.yml")
        with open(config, "w") as f:
            f.write("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
                    f"storage:\n  filesystem:\n    rootdirectory: {workdir}/storage\n"
                    f"http:\n  addr: 127.0.0.1:{self.port}\n  secret: nsbox-bench\n")
        self.log = open(os.path.join(workdir, "registry.log"), "wb")
        self.proc = subprocess.Popen([binary, "serve", config], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited (see {workdir}/registry.log)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("docker-registry did not listen in 15 s") from None
                time.sleep(0.02)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def bench_pull(n: int, notes: list[str]) -> list[Row]:
    """Pull + unpack of the debian fixture image (~75 MB unpacked) from a
    registry on 127.0.0.1, each time into an empty store, against `skopeo
    copy` to an OCI layout plus GNU tar of its layers into one directory."""
    op = "image: pull+unpack (loopback registry)"
    baseline = "skopeo copy to oci: + GNU tar -x of the layers"
    missing = [t for t in ("docker-registry", "skopeo") if tool(t) is None]
    if not os.path.isfile(os.path.join(OCI_LAYOUT, "index.json")):
        missing.append(f"{OCI_LAYOUT} (rootfs/images.sh)")
    if missing:
        return [Row(op, 0, None, f"{baseline} (n/a: missing {', '.join(missing)})", None, "ms", "ratio <= 1.50")]
    from nsbox.host import idmap
    from nsbox.sandbox import confined
    from nsbox.storage import Store
    from nsbox.storage.registry import pull

    mapping = idmap.detect()
    work = tempfile.mkdtemp(prefix="nsbox-bench-pull-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    registry = LoopbackRegistry(tool("docker-registry") or "", work)
    try:
        ref = f"{registry.host}/bench/debian:12"
        r = subprocess.run([tool("skopeo") or "", "copy", "-q", "--dest-tls-verify=false",
                            f"oci:{OCI_LAYOUT}:{OCI_TAG}", f"docker://{ref}"], capture_output=True, text=True)
        if r.returncode != 0:
            return [Row(op, 0, None, f"{baseline} (n/a: skopeo push failed: {r.stderr.strip()[-80:]})", None,
                        "ms", "ratio <= 1.50")]
        size = 0

        async def ns(dest: str) -> None:
            nonlocal size
            image = await pull(Store(Path(dest), runner=confined), ref)
            size = sum(e.stat(follow_symlinks=False).st_size for layer in image.layers
                       for e in _walk(os.fspath(layer))) if not size else size

        async def base(dest: str) -> None:
            layout = os.path.join(dest, "oci")
            subprocess.run([tool("skopeo") or "", "copy", "-q", "--src-tls-verify=false", f"docker://{ref}",
                            f"oci:{layout}:debian"], check=True, capture_output=True)
            with open(os.path.join(layout, "index.json")) as f:
                manifest_digest = json.load(f)["manifests"][0]["digest"]
            with open(os.path.join(layout, "blobs", *manifest_digest.split(":"))) as f:
                layers = json.load(f)["layers"]
            root = os.path.join(dest, "rootfs")
            os.mkdir(root)
            for layer in layers:  # GNU tar detects the compression itself
                subprocess.run(["tar", "--numeric-owner", "-xf", os.path.join(layout, "blobs", *layer["digest"].split(":")),
                                "-C", root], check=True, stdin=subprocess.DEVNULL)

        variants = {"nsbox": ns, "skopeo+tar": base}
        samples: dict[str, list[float]] = {k: [] for k in variants}
        items = list(variants.items())
        for i in range(n + 1):  # the first round warms the registry's and the page cache
            for name, fn in (items if i % 2 == 0 else items[::-1]):
                dest = tempfile.mkdtemp(prefix=f"{name.replace('+', '-')}-", dir=work)
                t0 = time.perf_counter()
                await fn(dest)
                elapsed = time.perf_counter() - t0
                if i:
                    samples[name].append(elapsed)
                await anyio.to_thread.run_sync(remove_layer, Path(dest), mapping)
    finally:
        registry.close()
        await anyio.to_thread.run_sync(remove_layer, Path(work), mapping)
    med = {k: statistics.median(v) for k, v in samples.items()}
    notes.append(f"pull+unpack: {size / MiB:.0f} MiB unpacked; " + "; ".join(
        f"{k} p10 {pct(v, 0.1):.2f} / p90 {pct(v, 0.9):.2f} s" for k, v in samples.items()))
    return [Row(op, n, med["nsbox"], baseline, med["skopeo+tar"], "ms", "ratio <= 1.50", lambda _v, r: r <= 1.5)]


def _walk(top: str) -> list[os.DirEntry[str]]:
    """Every entry under `top` this user can list (subuid mode: directories
    of other sandbox users may not be; the size is for the report only)."""
    out, stack = [], [top]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except PermissionError:
            continue
        with it:
            for e in it:
                out.append(e)
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return out


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

    n_exec, n_create, n_out, n_file = iters(200), iters(100), iters(40), iters(10)
    n_image, n_pull = iters(50), iters(5)
    for line in machine():
        print(line)
    print(f"iterations: exec {n_exec}, create+destroy {n_create}, 10 MiB exec {n_out}, "
          f"50 MiB files {n_file}, image create {n_image}, pull {n_pull}, RSS {RSS_SANDBOXES} sandboxes; "
          "medians after a warm-up, variants interleaved")
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
        rows += await bench_create_writeback(n_image, 3, notes)
        rows += await bench_limits(n_image, 5, notes)
        rows += await bench_image_create(n_image, 5, notes)
        rows += await bench_compose(n_image, 3, notes)
        rows += await bench_pull(n_pull, notes)
        rows += await bench_rss(RSS_SANDBOXES, notes)
    finally:
        if envs is not None:
            await LocalSandboxEnvironment.sample_cleanup("bench", None, envs, False)

    import provider  # bench/provider.py (imports this module's helpers)

    provider_notes: list[str] = []
    provider_rows = await provider.quick_rows(iters(200), iters(40), iters(60), args.rounds, provider_notes)

    print()
    print_table(rows)
    print()
    for note in notes:
        print("  " + note)
    provider.print_table(f"Inspect provider path ({args.rounds} rounds; ratio per round: medians)", provider_rows)
    for note in provider_notes:
        print("  " + note)
    print(f"  total time {time.perf_counter() - t_start:.1f} s")
    failed = [f"{r.operation} vs {r.baseline}" for r in (*rows, *provider_rows) if r.result == "FAIL"]
    if failed:
        print(f"targets missed: {', '.join(failed)}")
    return 1 if failed and args.check else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the provider rows (default 3)")
    args = parser.parse_args()
    sys.exit(anyio.run(amain, args))


if __name__ == "__main__":
    main()
