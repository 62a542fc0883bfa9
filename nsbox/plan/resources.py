"""Resource limits of a sandbox: the contributor of its plan (see
nsbox/plan/plan.py) for memory, pids_limit, cpus and disk.

How each limit is enforced depends on what the host offers (nsbox/host/probe.py
limit_support() decides, and `nsbox doctor` shows it):

- a cgroup: v1 controllers writable by this process (real root), or a
  delegated cgroup v2 subtree (a systemd user session's
  `systemd-run --user --scope -p Delegate=yes`). The sandbox gets a cgroup
  of its own, nsbox-<id>, in each controller; a plan hook moves its first
  process into it between clone and go, so every process of the sandbox
  starts inside it. memory: memory.limit_in_bytes / memory.max, swap
  included (a process that exceeds it is killed by the OOM killer: its
  exec returns 137, as in Docker); pids_limit: pids.max; cpus: a CFS quota
  per 100 ms period. The cgroups are removed once the init is gone (a plan
  cleanup), or by `nsbox rm`/`gc` for a detached sandbox (recorded in its
  run directory).
- otherwise, rlimits of the sandbox's first process (set with prlimit from
  the same hook, so the init and every command inherit them, and no
  process of the sandbox can raise them: that needs CAP_SYS_RESOURCE on
  the host): memory as RLIMIT_AS (address space of each process, not
  memory of the sandbox: allocations fail with ENOMEM instead of an OOM
  kill); pids_limit as RLIMIT_NPROC, which Linux >= 5.14 counts per user
  namespace, so it bounds the sandbox's processes and not the invoking
  user's others (on older kernels it would count every process of the
  user's uid on the host, and nsbox declines it); cpus cannot be
  approximated and is not enforced. Each approximation is said once per
  process on stderr. What RLIMIT_AS cannot see stays unbounded: memfd and
  SysV shared memory not mapped, pipe and socket buffers, kernel memory.
  strict_limits refuses a limit that no cgroup enforces, before anything
  of the sandbox exists.
- memory and disk, everywhere: the sandbox gets one tmpfs of the smaller
  of the two, and /tmp, /dev/shm and /run (and an /etc upper layer kept in
  memory) are directories of it, so that together they stay within the
  limit (each a tmpfs of its own would take up to half the host's memory,
  which RLIMIT_AS does not count); its inodes are capped too (one per KiB).
  With disk, the sandbox's upper layers live there too (instead of its
  layer directory on the host's disk): writing beyond it fails with
  ENOSPC; the data counts as memory (as the sandbox's own, under a memory
  cgroup).

A sandbox without limits gets none of this.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from . import steps as s
from ..errors import HostPrerequisiteError, warn_once
from ..host import probe
from .plan import Phase, Plan, Writable

CGROUPS_FILE = "cgroups"  # in the sandbox's run directory: the cgroups it has, one a line
CFS_PERIOD = 100_000  # microseconds
CONTROLLERS = {"memory": "memory", "pids_limit": "pids", "cpus": "cpu"}
LIMITS = ("memory", "pids_limit", "cpus", "disk")

# Tests switch the enforcement off to show that their tests fail without it.
enabled = True
# What the rlimit fallback for memory leaves unbounded, as warnings and `nsbox doctor` say it.
UNBOUNDED = ("it cannot bound memfd or SysV shared memory, pipe or socket buffers or other kernel memory "
             "(the tmpfs mounts share one of the limit's size); strict_limits refuses it")


@dataclass(frozen=True)
class ResourceLimits:
    memory: int | None = None
    pids_limit: int | None = None
    cpus: float | None = None
    disk: int | None = None
    strict: bool = False  # refuse what no cgroup enforces (strict_limits)

    @classmethod
    def of(cls, spec: object) -> "ResourceLimits":
        return cls(*(getattr(spec, name) for name in LIMITS), strict=getattr(spec, "strict_limits", False))

    def scratch(self) -> int | None:
        """The size of the sandbox's tmpfs (see above), if it has one."""
        sizes = [v for v in (self.memory, self.disk) if v is not None]
        return min(sizes) if sizes else None

    def requested(self) -> list[str]:
        return [name for name in LIMITS if getattr(self, name) is not None]


@functools.cache
def support() -> probe.LimitSupport:
    """How this host enforces each limit (looked at once per process)."""
    return probe.limit_support(probe.Host())


def _kernel_counts_nproc_per_userns() -> bool:
    version = probe.kernel_version()
    return version is not None and version >= (5, 14)


def plan_limits(limits: ResourceLimits) -> tuple[dict[str, tuple[str, str]], dict[int, int], list[str]]:
    """(cgroup limit -> (version, parent dir), rlimit -> value, what is
    approximated or not enforced, in words) for `limits` on this host."""
    sup = support()
    cgroups: dict[str, tuple[str, str]] = {}
    rlimits: dict[int, int] = {}
    notes: list[str] = []
    for name in ("memory", "pids_limit", "cpus"):
        value = getattr(limits, name)
        if value is None:
            continue
        if name in sup.cgroups:
            cgroups[name] = sup.cgroups[name]
        elif name == "memory":
            rlimits[resource.RLIMIT_AS] = value
            notes.append(f"memory is approximated by RLIMIT_AS (address space per process, not memory of the "
                         f"sandbox; allocations beyond it fail instead of an OOM kill); {UNBOUNDED}")
        elif name == "pids_limit" and _kernel_counts_nproc_per_userns():
            rlimits[resource.RLIMIT_NPROC] = value
            notes.append("pids_limit is approximated by RLIMIT_NPROC (per user of the sandbox, the init included)")
        elif name == "pids_limit":
            notes.append("pids_limit is not enforced: no cgroup, and this kernel (< 5.14) would count RLIMIT_NPROC "
                         "over all of your processes on the host")
        else:
            notes.append("cpus is not enforced: no cgroup cpu controller")
    return cgroups, rlimits, notes


def check(limits: ResourceLimits) -> None:
    """With strict_limits: refuses a limit that no cgroup enforces here,
    before anything of the sandbox exists."""
    if not limits.strict:
        return
    sup = support()
    weak = [name for name in ("memory", "pids_limit", "cpus")
            if getattr(limits, name) is not None and name not in sup.cgroups]
    if weak:
        how = "; ".join(f"{name} would be {sup.how[name]}" for name in weak)
        raise HostPrerequisiteError(f"strict_limits: this host cannot enforce {', '.join(weak)} (no cgroup for "
                                    f"{'it' if len(weak) == 1 else 'them'}: {how})",
                                    f"{probe.cgroup_fix(probe.Host())}; or drop strict_limits to accept the "
                                    "approximation (`nsbox doctor` says what this host enforces)")


def contribute(plan: Plan, limits: ResourceLimits, sandbox_id: str, run_dir: Path, mount_dir: Path) -> None:
    """Before mounts.contribute (the tmpfs holds /tmp, /dev/shm, /run, and
    the upper layers under a disk limit)."""
    if not enabled or not limits.requested():
        return
    size = limits.scratch()
    if size is not None:
        where = f"{plan.host_dir(mount_dir)}/disk"
        options = f"size={size},nr_inodes={max(1024, size >> 10)},mode=755"
        plan.add(Phase.MOUNT, s.mkdir(where, 0o700),
                 s.mount("tmpfs", where, "tmpfs", ("MS_NOSUID", "MS_NODEV"), options,
                         f"mount a tmpfs of {size} bytes for /tmp, /dev/shm, /run"
                         + (" and the writable layer" if limits.disk is not None else "")))
        plan.writable = Writable(where, size, layers=limits.disk is not None)
    cgroups, rlimits, notes = plan_limits(limits)
    for text in notes:
        warn_once(f"{text}; `nsbox doctor` says why")
    if not cgroups and not rlimits:
        return

    async def hook(pid: int) -> None:
        if cgroups:
            enter_cgroups(pid, limits, cgroups, sandbox_id, run_dir)
        for which, value in rlimits.items():
            resource.prlimit(pid, which, (value, value))

    plan.hooks.append(hook)
    if cgroups:
        plan.cleanups.append(lambda: remove_cgroups(run_dir))


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _settings(limits: ResourceLimits, name: str, version: str) -> list[tuple[str, str, bool]]:
    """(file, value, required) for limit `name` in a cgroup of `version`."""
    if name == "memory":
        if version == "v1":
            # memsw (memory + swap) after memory: it may not be below it.
            return [("memory.limit_in_bytes", str(limits.memory), True),
                    ("memory.memsw.limit_in_bytes", str(limits.memory), False)]
        return [("memory.max", str(limits.memory), True), ("memory.swap.max", "0", False)]
    if name == "pids_limit":
        return [("pids.max", str(limits.pids_limit), True)]
    assert limits.cpus is not None
    # More CPUs than the host has is no limit, and a quota past the kernel's
    # bound (2^44 us) would be refused: capped at the host's CPUs.
    quota = max(1000, round(min(limits.cpus, os.cpu_count() or 1) * CFS_PERIOD))
    if version == "v1":
        return [("cpu.cfs_period_us", str(CFS_PERIOD), True), ("cpu.cfs_quota_us", str(quota), True)]
    return [("cpu.max", f"{quota} {CFS_PERIOD}", True)]


def enter_cgroups(pid: int, limits: ResourceLimits, cgroups: dict[str, tuple[str, str]], sandbox_id: str,
                  run_dir: Path) -> None:
    """Creates the sandbox's cgroups, sets the limits and moves `pid` in."""
    by_dir: dict[Path, tuple[str, list[str]]] = {}
    for name, (version, parent) in cgroups.items():
        d = Path(parent) / f"nsbox-{sandbox_id}"
        by_dir.setdefault(d, (version, []))[1].append(name)
    # Recorded first: whatever fails below, teardown (or `nsbox rm`) removes them.
    with open(run_dir / CGROUPS_FILE, "a") as f:
        f.write("".join(f"{d}\n" for d in by_dir))
    for d, (version, names) in by_dir.items():
        if version == "v2":
            _enable_controllers(d.parent, [CONTROLLERS[n] for n in names])
        d.mkdir(mode=0o755, exist_ok=True)
        for name in names:
            for fname, value, required in _settings(limits, name, version):
                try:
                    _write(d / fname, value)
                except FileNotFoundError:
                    if required:
                        raise
        _write(d / "cgroup.procs", str(pid))


def _enable_controllers(parent: Path, controllers: list[str]) -> None:
    """cgroup v2: the controllers must be on in the parent's subtree_control.
    A cgroup with processes of its own cannot turn them on (the "no internal
    processes" rule): those processes (nsbox's own, in a scope delegated to
    it) move to a leaf, nsbox-host, first."""
    control = parent / "cgroup.subtree_control"
    try:
        enabled_now = set(control.read_text().split())
    except FileNotFoundError:
        enabled_now = set()
    wanted = " ".join(f"+{c}" for c in controllers if c not in enabled_now)
    if not wanted:
        return
    try:
        _write(control, wanted)
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        leaf = parent / "nsbox-host"
        leaf.mkdir(exist_ok=True)
        for pid in (parent / "cgroup.procs").read_text().split():
            try:
                _write(leaf / "cgroup.procs", pid)
            except ProcessLookupError:
                pass
        _write(control, wanted)


def remove_cgroups(run_dir: Path, wait: float = 2.0) -> None:
    """Removes the cgroups recorded in `run_dir` (their processes are gone
    or going: an init that exits takes every process of its PID namespace
    with it). Best effort; the record goes once they are all removed."""
    record = run_dir / CGROUPS_FILE
    try:
        dirs = [Path(line) for line in record.read_text().splitlines() if line]
    except FileNotFoundError:
        return
    deadline = time.monotonic() + wait
    left = []
    for d in dirs:
        while True:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.EBUSY and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                left.append(d)
            break
    if left:
        record.write_text("".join(f"{d}\n" for d in left))
        warn_once(f"cannot remove the cgroups {', '.join(map(str, left))}: `nsbox gc` tries again")
    else:
        record.unlink(missing_ok=True)
