"""Which limit creating a sandbox ran into, and how to raise it.

Creating a sandbox takes descriptors, processes, namespaces, memory and
disk; any of them may run out (the soft RLIMIT_NOFILE after thousands of
sandboxes, RLIMIT_NPROC or a pids cgroup, user.max_user_namespaces, a
full filesystem). The system call then fails with a bare errno, and
"[Errno 24] Too many open files" says neither which limit it is nor what
to do. This module is the one place that turns such an errno into a
ResourceExhausted error naming the limit, its value and the way to raise
it: Sandbox.start does for whatever creating the sandbox raised
(translate), the launch does for a failed clone or setup step (of_clone,
of_setup), and a descriptor limit too low for any sandbox is refused
before anything exists (check_nofile).

What the kernel reports depends on where it failed: ENOSPC from clone or
unshare is a namespace limit (max_*_namespaces), from a file a full
filesystem; EAGAIN from clone or fork is a process limit. A failed clone
comes as a CloneError (nsbox/create/zygote.py) for that reason.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

from ..errors import NsboxError, ResourceExhausted
from ..host import probe as facts
from ..plan.steps import PATH_FD_BASE
from . import hostcheck, zygote
from .zygote import CloneError

# What a file operation fails with when a limit is reached.
FILE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT})

KEEP = " (and in /etc/sysctl.d/ to keep it)"
CLOSE_SOME = "close sandboxes you no longer need"

# The setup of a sandbox parks descriptors from PATH_FD_BASE (200) on, one
# per host path its mounts use: below this limit it cannot.
MIN_NOFILE = PATH_FD_BASE + 56

NAMESPACES = ("user", "mnt", "pid", "ipc", "uts", "cgroup", "net")


def translate(e: BaseException) -> NsboxError | None:
    """The resource-limit error that `e`, raised while creating a sandbox,
    stands for (for a failed clone, the host's refusal hostcheck names if it
    is none); None if it is not one."""
    if isinstance(e, NsboxError) and not isinstance(e, ResourceExhausted):
        # An error of nsbox's own that a limit caused (a state directory
        # that could not be made, say): the limit is what to fix.
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OSError) and not isinstance(cause, CloneError) and cause.errno in FILE_ERRNOS:
            return of_errno(cause.errno, cause.filename)
        return None
    if not isinstance(e, OSError) or e.errno is None:
        return None
    if isinstance(e, CloneError):
        return of_clone(e.errno) or hostcheck.clone_failed(e.errno)
    if e.errno == errno.EAGAIN:  # fork of a helper (subprocess): only a limit found reached counts
        return _processes(required=False)
    return of_errno(e.errno, e.filename)


def of_clone(err: int) -> ResourceExhausted | None:
    """The error for a clone (or unshare) of a sandbox's process that
    failed with `err`; None if that is not a resource limit."""
    if err == errno.EAGAIN:
        return _processes(required=True)
    if err == errno.ENOSPC:
        return _namespaces()
    if err in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
        return of_errno(err, None)
    return None


def of_setup(err: int, *, clones: bool, places_fds: bool, path: str | os.PathLike[str],
             mounts: bool = False) -> ResourceExhausted | None:
    """The error for a setup step of the sandbox's first process that
    failed with `err`: one that `clones` (the namespaces that lock its
    mounts), one that `places_fds` (at fixed numbers, up to
    PATH_FD_BASE and above: beyond the limit is EINVAL or EBADF), one that
    `mounts` (ENOSPC there is the limit of mounts, not a full disk), or one
    on the writable layer at `path`."""
    if places_fds and err in (errno.EINVAL, errno.EBADF, errno.EMFILE):
        return _descriptors()
    if mounts and err == errno.ENOSPC:
        return _limit("the limit of mounts is reached", "fs.mount-max",
                      f"{CLOSE_SOME} (each holds a few dozen mounts), or `sudo sysctl -w fs.mount-max=N`{KEEP}",
                      f"fs.mount-max {facts.sysctl('fs.mount-max') or '?'}")
    return of_clone(err) if clones else of_errno(err, path)


def check_nofile() -> None:
    """Refuses, before anything exists, a descriptor limit below what the
    setup of a sandbox needs: it places descriptors from PATH_FD_BASE on.
    The limit that counts is the zygote's (its children inherit it), this
    process's until it runs (it will inherit this one)."""
    for pid in sorted(zygote.helper_pids()) or [0]:
        try:
            soft, _ = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        except OSError:
            continue
        if soft != resource.RLIM_INFINITY and soft < MIN_NOFILE:
            raise _descriptors(soft)


def of_errno(err: int, path: str | os.PathLike[str] | bytes | None) -> ResourceExhausted | None:
    """The error for a system call that failed with `err` (on `path`, a
    file, where known); None if that is not a resource limit."""
    if err == errno.EMFILE:
        return _descriptors()
    if err == errno.ENFILE:
        return _limit("the host's table of open files is full", "fs.file-max",
                      f"`sudo sysctl -w fs.file-max=N`{KEEP}, or {CLOSE_SOME}",
                      detail=f"fs.file-nr (in use, free, max): {facts.sysctl('fs.file-nr') or '?'}")
    if err == errno.ENOMEM:
        return _memory()
    if err in (errno.ENOSPC, errno.EDQUOT):
        return _disk(err, path)
    return None


# ---- each limit ----------------------------------------------------------

def _limit(what: str, limit: str, hint: str, detail: str = "") -> ResourceExhausted:
    return ResourceExhausted(f"cannot create the sandbox: {what}" + (f" ({detail})" if detail else ""),
                             hint=hint, limit=limit)


def _descriptors(too_low: int | None = None) -> ResourceExhausted:
    """`too_low`: the limit of the process that clones sandboxes, below
    what their setup needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"RLIMIT_NOFILE soft {_shown(soft)}, hard {_shown(hard)}"
    what = "too many open files in this process"
    if too_low is not None:
        what = f"the limit of open files is below the {MIN_NOFILE} that a sandbox's setup needs"
        detail += "" if too_low == soft else f"; nsbox-create's soft limit {too_low}"
    else:
        try:
            detail += f"; {len(os.listdir('/proc/self/fd')) - 1} open now"
        except OSError:
            pass
    if soft != hard:
        hint = (f"raise the soft limit up to the hard one: `ulimit -n {_shown(hard)}` in the shell that starts "
                f"this program (or resource.setrlimit), or {CLOSE_SOME}")
    else:
        hint = (f"raise the hard limit (as root: `ulimit -Hn N`, LimitNOFILE= in a systemd unit, nofile in "
                f"/etc/security/limits.conf), or {CLOSE_SOME}")
    return _limit(what, "RLIMIT_NOFILE", hint, detail)


def _processes(required: bool) -> ResourceExhausted | None:
    """EAGAIN from clone or fork: which process limit is reached. With
    `required`, one that cannot be told still gives the error."""
    # The zygote and its holders clone: their limits count, not this
    # process's (alike, unless changed since they started).
    clones = sorted(zygote.helper_pids()) or [os.getpid()]
    cgroup = next(filter(None, map(_pids_cgroup_reached, clones)), None)
    if cgroup is not None:
        path, current, maximum = cgroup
        return _limit("the cgroup's limit of processes is reached", "pids.max",
                      f"{CLOSE_SOME}, or raise {path}/pids.max (systemd: TasksMax=)",
                      f"pids.max {maximum}, pids.current {current}")
    soft, hard = min((_nproc(pid) for pid in clones), key=lambda lim: _finite(lim[0]))
    if soft != resource.RLIM_INFINITY and not _exempt_from_nproc() and _user_tasks(os.getuid()) >= soft * 9 // 10:
        return _limit("the limit of processes of your user is reached", "RLIMIT_NPROC",
                      f"{CLOSE_SOME}, or raise the limit: `ulimit -u N` (up to the hard one; as root: nproc in "
                      "/etc/security/limits.conf, TasksMax= of a systemd unit)",
                      f"RLIMIT_NPROC soft {_shown(soft)}, hard {_shown(hard)}; the processes of every sandbox "
                      "count as yours")
    threads = _tasks()
    for name in ("kernel.threads-max", "kernel.pid_max"):
        value = facts.sysctl(name)
        if value and value.isdigit() and threads >= int(value) * 9 // 10:
            return _limit(f"the host's limit of processes is reached ({name} {value}, {threads} running)",
                          name, f"{CLOSE_SOME}, or `sudo sysctl -w {name}=N`{KEEP}")
    if not required:
        return None
    return _limit("no more processes can be created (EAGAIN from clone)", "processes",
                  f"{CLOSE_SOME}; check `ulimit -u`, the pids.max of your cgroup and kernel.threads-max",
                  f"RLIMIT_NPROC soft {_shown(soft)}, hard {_shown(hard)}; {threads} processes running")


def _namespaces() -> ResourceExhausted | None:
    """ENOSPC from clone: a max_*_namespaces limit; a probe finds which.
    None where it is 0: disabled rather than used up, as hostcheck says."""
    kind = _probe_namespace_limit()
    inner = "" if _in_initial_userns() else (
        " (this is the limit of the user namespace nsbox runs in: its owner sets it, from outside)")
    if kind is None:
        values = ", ".join(f"user.max_{k}_namespaces={facts.sysctl(f'user.max_{k}_namespaces') or '?'}"
                           for k in NAMESPACES)
        return _limit("a limit of namespaces is reached (ENOSPC from clone)", "user.max_*_namespaces",
                      f"{CLOSE_SOME} (each holds a few namespaces), or raise the limit that is reached with "
                      f"`sudo sysctl -w user.max_KIND_namespaces=N`{inner or KEEP}",
                      f"{values}; or user namespaces are nested 32 deep, the kernel's most")
    name = f"user.max_{kind}_namespaces"
    value = facts.sysctl(name) or "?"
    if value == "0":
        return None
    return _limit(f"the limit of {kind} namespaces is reached: {name} is {value}", name,
                  f"{CLOSE_SOME} (each holds a few namespaces), or raise it: "
                  f"`sudo sysctl -w {name}=15000`{inner or KEEP}")


def _memory() -> ResourceExhausted:
    detail = []
    avail = _meminfo("MemAvailable")
    if avail is not None:
        detail.append(f"MemAvailable {avail // 1024} MiB")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        detail.append(f"RLIMIT_AS {soft // (1 << 20)} MiB")
    return _limit("out of memory", "memory", f"free memory: {CLOSE_SOME}, or raise `ulimit -v` and the memory "
                  "limit of your cgroup (systemd: MemoryMax=)", ", ".join(detail))


def _disk(err: int, path: str | os.PathLike[str] | bytes | None) -> ResourceExhausted:
    where = os.fsdecode(path) if path is not None else _state_dir()
    detail = ""
    try:
        st = os.statvfs(_existing(where))
        detail = f"{st.f_bavail * st.f_frsize // (1 << 20)} MiB and {st.f_favail} inodes free"
    except OSError:
        pass
    move = "or set NSBOX_STATE_DIR to a directory on a filesystem with room"
    if err == errno.EDQUOT:
        return _limit(f"your disk quota is exceeded on the filesystem of {where}", "disk quota",
                      f"free some of your space there (`quota -s` shows it), {move}", detail)
    return _limit(f"no space left on the filesystem of {where}", "disk space",
                  f"free space there ({CLOSE_SOME}; `nsbox image prune` removes unused images), {move}", detail)


# ---- what the host says ----------------------------------------------------

def _finite(limit: int) -> float:
    return float("inf") if limit == resource.RLIM_INFINITY else limit


def _shown(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo(field: str) -> int | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _state_dir() -> str:
    try:
        from ..host import dirs
        return os.fspath(dirs.data_dir())
    except Exception:  # noqa: BLE001 - it may be what cannot be made
        return os.environ.get("NSBOX_STATE_DIR", "the state directory")


def _existing(path: str) -> str:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.fspath(p)


def _in_initial_userns() -> bool:
    return (_read("/proc/self/uid_map") or "").split() == ["0", "0", "4294967295"]


def _exempt_from_nproc() -> bool:
    """Root of the host (or a process with CAP_SYS_RESOURCE or CAP_SYS_ADMIN
    there) is not held to RLIMIT_NPROC."""
    if not _in_initial_userns():
        return False
    if os.getuid() == 0:
        return True
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
            return bool(caps & (1 << 21 | 1 << 24))
    return False


def _tasks() -> int:
    """The threads running on the host (what threads-max counts)."""
    count = 0
    for p in os.listdir("/proc"):
        try:
            count += len(os.listdir(f"/proc/{p}/task")) if p.isdigit() else 0
        except OSError:
            pass  # exited meanwhile
    return count


def _user_tasks(uid: int) -> int:
    """The threads whose real uid is `uid` (what RLIMIT_NPROC counts; the
    sandboxes' processes of its own id included)."""
    count = 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        status = _read(f"/proc/{p}/status") or ""
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (KeyError, ValueError, IndexError):
            pass  # exited meanwhile
    return count


def _nproc(pid: int) -> tuple[int, int]:
    try:
        return resource.prlimit(pid, resource.RLIMIT_NPROC)
    except OSError:
        return resource.getrlimit(resource.RLIMIT_NPROC)


def _pids_cgroup_reached(pid: int) -> tuple[str, int, int] | None:
    """(cgroup directory, pids.current, pids.max) of a cgroup of process
    `pid` (or one above it) whose limit of processes is reached."""
    for line in (_read(f"/proc/{pid}/cgroup") or "").splitlines():
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            base = Path("/sys/fs/cgroup")
            if (base / "unified").is_dir() and not (base / "cgroup.controllers").exists():
                base = base / "unified"
        elif "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids")
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            maximum, current = _read(os.fspath(d / "pids.max")), _read(os.fspath(d / "pids.current"))
            if maximum and current and maximum.isdigit() and int(current) >= int(maximum):
                return os.fspath(d), int(current), int(maximum)
            if d == base or d == d.parent:
                break
            d = d.parent
    return None


# Tries each kind of namespace in a fresh interpreter (a new user namespace,
# then each other kind inside it, as a sandbox's are made) and prints the
# first whose creation fails with ENOSPC.
_PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
FLAGS = {"user": 0x10000000, "mnt": 0x20000, "pid": 0x20000000, "ipc": 0x8000000, "uts": 0x4000000,
         "cgroup": 0x2000000, "net": 0x40000000}
for kind, flag in FLAGS.items():
    if libc.unshare(flag) != 0:
        if ctypes.get_errno() == errno.ENOSPC:
            print(kind)
        break
"""


def _probe_namespace_limit() -> str | None:
    """Which kind of namespace cannot be created now for want of room."""
    try:
        r = subprocess.run([sys.executable, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=10,
                           check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    kind = r.stdout.strip()
    return kind if kind in NAMESPACES else None
