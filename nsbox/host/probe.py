"""Facts about this host that decide what nsbox can do here: sysctls, the
kernel's version, the container runtime around this process, the mount
table, this process's seccomp mode, and how each resource limit would be
enforced (cgroups or their approximations).

Each fact is read in one place. Where the reading looks is a `Host`; tests
point it at fake sysctls and cgroup trees, and replace the real attempts,
to simulate hosts that cannot be produced here. `nsbox doctor`
(nsbox/cli/doctor.py) shows these facts; nsbox/create/hostcheck.py turns
them into the cause and the fix of a failure.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

PROC_SYS = Path("/proc/sys")
MOUNTINFO = "/proc/self/mountinfo"


def sysctl(name: str, proc_sys: Path = PROC_SYS) -> str | None:
    """The value of sysctl `name` ("user.max_user_namespaces"), None if this
    kernel has none."""
    try:
        return (proc_sys / name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def kernel_version(release: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of a kernel release ("5.10.0-28-amd64"; default: this
    kernel's), None if it does not say."""
    m = re.match(r"(\d+)\.(\d+)", platform.release() if release is None else release)
    return (int(m.group(1)), int(m.group(2))) if m else None


def kernel_older_than(major: int, minor: int) -> bool:
    """Whether this kernel is older than major.minor (False if unknown)."""
    version = kernel_version()
    return version is not None and version < (major, minor)


def in_container() -> str | None:
    """The container runtime this process runs under, if it says so."""
    if os.path.exists("/.dockerenv"):
        return "Docker"
    if os.path.exists("/run/.containerenv"):
        return "Podman"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "Kubernetes"
    return None


class Mount(NamedTuple):
    point: str  # the mount point
    fstype: str
    options: str  # the super block's options


def mountinfo(path: str | os.PathLike[str] = MOUNTINFO) -> list[Mount]:
    """The mounts of a mount table (/proc/self/mountinfo); what could be
    read of it if it cannot be read to the end."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _source, options = (right.split() + ["", "", ""])[:3]
                out.append(Mount(left.split()[4].replace("\\040", " "), fstype, options))
    except (OSError, IndexError):
        pass
    return out


def fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding `path` (from mountinfo)."""
    real = os.path.realpath(path)
    best, best_type = "", None
    for m in mountinfo():
        inside = real == m.point or real.startswith(m.point.rstrip("/") + "/")
        if inside and len(m.point) >= len(best):
            best, best_type = m.point, m.fstype
    return best_type


@dataclass(frozen=True)
class SandboxAttempt:
    ok: bool
    message: str  # one line: how long it took, or why it failed


# What the namespace probe found, per stage: "ok", an errno name, or absent
# when an earlier stage failed. Stages: clone3, userns, idmap, mntns, proc,
# overlay.
Probe = Mapping[str, str]


@dataclass(frozen=True)
class Host:
    """Where the doctor looks, and how it tries things; tests swap parts."""

    proc_sys: Path = PROC_SYS
    proc_self: Path = Path("/proc/self")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    tun: Path = Path("/dev/net/tun")
    kernel_release: str = field(default_factory=platform.release)
    euid: int = field(default_factory=os.geteuid)
    probe: Callable[[], Probe] | None = None  # default: create.hostcheck.probe_namespaces()
    sandbox: Callable[[], SandboxAttempt] | None = None  # default: cli.doctor.try_sandbox()

    def sysctl(self, name: str) -> str | None:
        return sysctl(name, self.proc_sys)

    def seccomp_mode(self) -> tuple[int | None, int]:
        """(Seccomp, Seccomp_filters) of this process: 0 none, 2 filter;
        None when the kernel has no seccomp filters (the status line
        Seccomp_filters exists with CONFIG_SECCOMP_FILTER)."""
        values: dict[str, int] = {}
        try:
            for line in (self.proc_self / "status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("Seccomp", "Seccomp_filters"):
                    values[key] = int(value)
        except (OSError, ValueError):
            pass
        if "Seccomp_filters" not in values:
            return None, 0
        return values.get("Seccomp", 0), values["Seccomp_filters"]


# ---- resource limits ----------------------------------------------------

@dataclass(frozen=True)
class LimitSupport:
    """How each resource limit of the issue would be enforced on this host."""

    cgroup: str  # "v2", "v1", or "none"
    where: str | None  # the cgroup directory nsbox would work under
    how: Mapping[str, str]  # limit name -> how it is enforced
    enforced: frozenset[str]  # limits enforced exactly (by a cgroup)
    # limit -> (cgroup version, the directory a sandbox's cgroup goes in)
    cgroups: Mapping[str, tuple[str, str]] = field(default_factory=dict)


FALLBACK = {
    "memory": "approximated by RLIMIT_AS per process (address space, not memory, and not per sandbox; memfd and "
              "SysV shared memory, pipe and socket buffers and kernel memory are not bounded; /tmp, /dev/shm and "
              "/run share one tmpfs of the limit's size)",
    "pids_limit": "approximated by RLIMIT_NPROC (per user of the sandbox; Linux >= 5.14 counts it per user "
                  "namespace, so your processes outside do not count)",
    "cpus": "not enforced (no cgroup cpu controller)",
}
DISK = ("a size-limited tmpfs holds the writable layer with /tmp, /dev/shm and /run (its data counts as "
        "memory)")


def _cgroup_lines(host: Host) -> list[tuple[str, list[str], str]]:
    try:
        text = (host.proc_self / "cgroup").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[0], [c for c in parts[1].split(",") if c], parts[2]))
    return out


def _cgroup_mounts(host: Host) -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, super options) of cgroup filesystems."""
    return [(m.point, m.fstype, m.options.split(",")) for m in mountinfo(host.proc_self / "mountinfo")
            if m.fstype in ("cgroup", "cgroup2")]


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _relocate(mount_point: str, host: Host) -> Path:
    """A mount point under /sys/fs/cgroup, seen under host.cgroup_root."""
    rel = os.path.relpath(mount_point, "/sys/fs/cgroup")
    return host.cgroup_root if rel == "." else host.cgroup_root / rel


def limit_support(host: Host) -> LimitSupport:
    lines = _cgroup_lines(host)
    mounts = _cgroup_mounts(host)
    v2_path = next((path for hid, ctrls, path in lines if hid == "0" and not ctrls), None)
    v2_mount = next((mp for mp, fstype, _ in mounts if fstype == "cgroup2"), None)
    v1 = {c: path for hid, ctrls, path in lines if hid != "0" for c in ctrls}
    how = dict(FALLBACK)
    enforced: set[str] = set()
    cgroups: dict[str, tuple[str, str]] = {}
    names = {"memory": "memory", "pids_limit": "pids", "cpus": "cpu"}

    # cgroup v1 controllers (mounted on their own, as root can use them).
    v1_dirs: dict[str, Path] = {}
    for mp, fstype, opts in mounts:
        if fstype != "cgroup":
            continue
        for limit, controller in names.items():
            if controller in opts and controller in v1:
                v1_dirs[limit] = _relocate(mp, host) / v1[controller].lstrip("/")
    for limit, d in v1_dirs.items():
        if _writable(d):
            files = {"memory": "memory.limit_in_bytes", "pids_limit": "pids.max", "cpus": "cpu.cfs_quota_us"}
            how[limit] = f"cgroup v1 {files[limit]} under {d}"
            enforced.add(limit)
            cgroups[limit] = ("v1", str(d))

    # cgroup v2: our own cgroup, if it is ours to write (a delegated subtree).
    where: str | None = None
    if v2_mount is not None and v2_path is not None:
        d = _relocate(v2_mount, host) / v2_path.lstrip("/")
        try:
            controllers = set((d / "cgroup.controllers").read_text().split())
        except OSError:
            controllers = set()
        if _writable(d) and os.access(d / "cgroup.procs", os.W_OK):
            where = str(d)
            files = {"memory": "memory.max", "pids_limit": "pids.max", "cpus": "cpu.max"}
            for limit, controller in names.items():
                if limit not in enforced and controller in controllers:
                    how[limit] = f"cgroup v2 {files[limit]} under {d}"
                    enforced.add(limit)
                    cgroups[limit] = ("v2", str(d))
    if v1_dirs and any(k in enforced for k in v1_dirs):
        version = "v1"
        where = where or str(next(iter(v1_dirs.values())))
    else:
        version = "v2" if where else "none"
    how["disk"] = DISK
    return LimitSupport(version, where, how, frozenset(enforced), cgroups)


def cgroup_fix(host: Host) -> str:
    """How to get cgroups nsbox may use, on this host."""
    unified = any(fstype == "cgroup2" and mp == "/sys/fs/cgroup" for mp, fstype, _ in _cgroup_mounts(host))
    if unified:
        return ("run nsbox in a delegated cgroup: in a systemd user session, "
                "`systemd-run --user --scope -p Delegate=yes nsbox ...` (`loginctl enable-linger $USER` keeps "
                "one without a login)")
    return ("this host mounts cgroup v1, which cannot be delegated to an unprivileged user: run nsbox as root, "
            "or boot with the unified hierarchy (systemd.unified_cgroup_hierarchy=1) and a systemd user session")
