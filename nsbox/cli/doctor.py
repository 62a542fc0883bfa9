"""`nsbox doctor`: can nsbox run on this host, and what can it enforce here?

Each check tries the real thing where it can, and reads sysctls and files
only to explain a failure: a child process creates a user namespace,
writes its id maps, mounts a fresh /proc and an overlayfs in it; a sandbox
is created and runs `true`. Every check ends in pass, warn (nsbox runs,
but something is missing or approximated) or fail (nsbox cannot run), with
the fix on one line. `nsbox doctor` exits 1 when a check fails.

Where the doctor looks is a `Host`; tests point it at fake sysctls and
cgroup trees, and replace the two real attempts, to simulate hosts that
cannot be produced here.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import click

from ..create import hostcheck
from ..errors import HostPrerequisiteError
from ..host.layers import etc_upper_in_memory
from ..plan.overlay import OVERLAY_OPTIONS

Status = Literal["pass", "warn", "fail"]
MIN_KERNEL = (5, 12)
# A sandbox holds about four descriptors in the process that owns it.
FDS_PER_SANDBOX = 4
NOFILE_FAIL, NOFILE_WARN = 64, 4096
SUBUID_HINT = ("give yourself a subordinate id range and install newuidmap: as root, "
               "`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $USER` and `apt-get install uidmap`")
SECCOMP_FIXES = {
    "Docker": "run the container with `--security-opt seccomp=unconfined` "
              "(or a profile that allows unshare and clone with CLONE_NEWUSER)",
    "Podman": "run the container with `--security-opt seccomp=unconfined`",
    "Kubernetes": "set `securityContext.seccompProfile.type: Unconfined` on the pod "
                  "(or a Localhost profile that allows CLONE_NEWUSER)",
}
UNMASK_PROC_FIX = ("inside a container, unmask /proc: Docker and Podman `--security-opt systempaths=unconfined`, "
                   "Kubernetes `securityContext.procMount: Unmasked` (with `hostUsers: false`)")
APPARMOR_FIX = ("let nsbox's helper create them: `{python} -m nsbox.cli.doctor --apparmor-profile | sudo tee "
                "/etc/apparmor.d/nsbox && sudo apparmor_parser -r /etc/apparmor.d/nsbox` "
                "(see contrib/apparmor/nsbox), or lift the restriction for every program: "
                "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`")


def _apparmor_fix() -> str:
    return APPARMOR_FIX.format(python=shlex.quote(sys.executable))


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    summary: str
    fix: str | None = None
    details: Mapping[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "details": dict(self.details)}


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

    proc_sys: Path = Path("/proc/sys")
    proc_self: Path = Path("/proc/self")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    tun: Path = Path("/dev/net/tun")
    kernel_release: str = field(default_factory=platform.release)
    euid: int = field(default_factory=os.geteuid)
    probe: Callable[[], Probe] | None = None  # default: probe_namespaces()
    sandbox: Callable[[], SandboxAttempt] | None = None  # default: try_sandbox()

    def sysctl(self, name: str) -> str | None:
        try:
            return (self.proc_sys / name.replace(".", "/")).read_text().strip()
        except OSError:
            return None

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


# ---- the real attempts -------------------------------------------------

_PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, SIGCHLD = 0x10000000, 0x20000, 0x20000000, 17
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
res = {}
def name(e):
    return errno.errorcode.get(e, str(e))
def done():
    print(json.dumps(res), flush=True)
    os._exit(0)

# clone3 into a new user namespace, as nsbox-create does; the child exits.
class CloneArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls")]
args = CloneArgs(flags=CLONE_NEWUSER, exit_signal=SIGCHLD)
pid = libc.syscall(ctypes.c_long(435), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
if pid == 0:
    os._exit(0)
res["clone3"] = "ok" if pid > 0 else name(ctypes.get_errno())
if pid > 0:
    os.waitpid(pid, 0)

uid, gid = os.geteuid(), os.getegid()
if libc.unshare(CLONE_NEWUSER) != 0:
    res["userns"] = name(ctypes.get_errno()); done()
res["userns"] = "ok"
try:
    for f, text in (("setgroups", "deny"), ("uid_map", "0 %d 1\n" % uid), ("gid_map", "0 %d 1\n" % gid)):
        with open("/proc/self/" + f, "w") as fh:
            fh.write(text)
except OSError as e:
    res["idmap"] = name(e.errno); done()
res["idmap"] = "ok"
if libc.unshare(CLONE_NEWNS | CLONE_NEWPID) != 0:
    res["mntns"] = name(ctypes.get_errno()); done()
res["mntns"] = "ok"
print(json.dumps(res), flush=True)
res = {}
if os.fork() == 0:
    # PID 1 of the new PID namespace: a fresh /proc, then an overlayfs.
    work = sys.argv[1]
    r = libc.mount(b"proc", (work + "/proc").encode(), b"proc", ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None)
    res["proc"] = "ok" if r == 0 else name(ctypes.get_errno())
    # argv[2]: the options nsbox mounts its overlays with (nsbox/plan/overlay.py).
    opts = "lowerdir=%s/lower,upperdir=%s/upper,workdir=%s/work,%s" % (work, work, work, sys.argv[2])
    r = libc.mount(b"overlay", (work + "/merged").encode(), b"overlay", ctypes.c_ulong(0), opts.encode())
    if r != 0:
        res["overlay"] = name(ctypes.get_errno())
    else:
        try:
            with open(work + "/merged/probe", "w") as fh:
                fh.write("x")
            res["overlay"] = "ok"
        except OSError as e:
            res["overlay"] = name(e.errno)
    done()
os.wait()
"""


def _state_parent() -> Path:
    """A directory on the filesystem that holds sandboxes' writable layers."""
    from ..host import dirs
    try:
        return dirs.data_dir()
    except Exception:  # noqa: BLE001 - any filesystem will do for the probe then
        return Path(tempfile.gettempdir())


def _remove_tree(path: Path) -> None:
    # overlayfs leaves its work directory (work/work) with mode 0.
    for parent, subdirs, _ in os.walk(path):
        for d in subdirs:
            if not os.path.islink(os.path.join(parent, d)):
                os.chmod(os.path.join(parent, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def probe_namespaces() -> Probe:
    """Creates a user namespace as nsbox does, in a child process, and
    reports how far it got."""
    work = Path(tempfile.mkdtemp(prefix="doctor-", dir=_state_parent()))
    try:
        for d in ("proc", "lower", "upper", "work", "merged"):
            (work / d).mkdir()
        r = subprocess.run([sys.executable, "-I", "-c", _PROBE, str(work), OVERLAY_OPTIONS], check=False,
                           capture_output=True, text=True, timeout=30)
        results: dict[str, str] = {}
        for line in r.stdout.splitlines():
            try:
                results.update(json.loads(line))
            except ValueError:
                pass
        if not results:
            results["userns"] = f"probe-failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"
        return results
    except subprocess.TimeoutExpired:
        return {"userns": "probe-timed-out"}
    finally:
        _remove_tree(work)


def try_sandbox(timeout: float = 60.0) -> SandboxAttempt:
    """Creates a sandbox on the host root and runs `true` in it."""
    try:
        import anyio

        import nsbox

        async def attempt() -> int:
            with anyio.fail_after(timeout):
                async with nsbox.Sandbox() as sb:
                    return (await sb.exec(["true"])).returncode

        start = time.monotonic()
        code = anyio.run(attempt)
        took = (time.monotonic() - start) * 1000
        if code != 0:
            return SandboxAttempt(False, f"the sandbox was created, but `true` exited with {code}")
        return SandboxAttempt(True, f"created a sandbox and ran `true` in it ({took:.0f} ms)")
    except Exception as e:  # noqa: BLE001 - the message is what a person needs, whatever went wrong
        text = " ".join(str(e).split()) or type(e).__name__
        return SandboxAttempt(False, text)


# ---- the checks --------------------------------------------------------

def _kernel_version(release: str) -> tuple[int, int] | None:
    try:
        major, minor = release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return None


def check_kernel(host: Host) -> Check:
    version = _kernel_version(host.kernel_release)
    need = ".".join(map(str, MIN_KERNEL))
    if version is None:
        return Check("kernel", "warn", f"cannot tell the kernel version from {host.kernel_release!r}")
    if version < MIN_KERNEL:
        return Check("kernel", "fail", f"Linux {host.kernel_release} is too old: nsbox needs {need} or later "
                     "(openat2, mount_setattr, overlayfs in user namespaces)",
                     "upgrade the kernel (or run nsbox on a newer host)")
    return Check("kernel", "pass", f"Linux {host.kernel_release} ({platform.machine()}; nsbox needs {need}+)")


def _in_container() -> str | None:
    return hostcheck._in_container()


def _seccomp_fix() -> str:
    runtime = _in_container()
    if runtime in SECCOMP_FIXES:
        return SECCOMP_FIXES[runtime]
    return ("start nsbox outside the program that installed the filter; in a container: "
            + "; ".join(f"{name}: {fix}" for name, fix in SECCOMP_FIXES.items()))


def diagnose_userns(host: Host, probe: Probe) -> tuple[str, str]:
    """Why user namespaces fail here, and the fix: (cause, fix)."""
    userns, idmap = probe.get("userns", "?"), probe.get("idmap")
    maxns = host.sysctl("user.max_user_namespaces")
    if host.sysctl("kernel.unprivileged_userns_clone") == "0" and host.euid != 0:
        return ("unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone=0)",
                "`sudo sysctl -w kernel.unprivileged_userns_clone=1` (and in /etc/sysctl.d/ to keep it)")
    if maxns == "0":
        return ("user namespaces are disabled (user.max_user_namespaces=0)",
                "`sudo sysctl -w user.max_user_namespaces=15000` (and in /etc/sysctl.d/ to keep it)")
    if userns == "ENOSPC":
        return (f"the limit of {maxns} user namespaces (user.max_user_namespaces) is used up: "
                + "running sandboxes (two each) or other programs hold them",
                "close some, or raise it: `sudo sysctl -w user.max_user_namespaces=15000`")
    seccomp, filters = host.seccomp_mode()
    if seccomp == 2 and (userns == "EPERM" or probe.get("clone3") == "ENOSYS"):
        pattern = (" (unshare: EPERM, clone3: ENOSYS: Docker's default profile does this)"
                   if userns == "EPERM" and probe.get("clone3") == "ENOSYS" else "")
        return (f"a seccomp filter on this process ({filters} filter(s)) refuses new user namespaces{pattern}",
                _seccomp_fix())
    denied = {"EPERM", "EACCES"}
    if host.sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1" and (userns in denied or idmap in denied):
        return ("AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1, "
                + "Ubuntu 23.10+): a new namespace gets no capabilities, so its id maps cannot be written",
                _apparmor_fix())
    stage = "writing its id maps" if userns == "ok" else "creating it"
    return (f"creating a user namespace failed ({stage}: {idmap if userns == 'ok' else userns})",
            hostcheck.userns_hint())


def check_userns(host: Host, probe: Probe, sandbox: SandboxAttempt) -> Check:
    maxns = host.sysctl("user.max_user_namespaces")
    details = {"probe": dict(probe), "user.max_user_namespaces": maxns}
    if probe.get("userns") == "ok" and probe.get("idmap") == "ok":
        if maxns is not None and maxns.isdigit() and int(maxns) < 64:
            return Check("userns", "warn", f"user namespaces work, but user.max_user_namespaces={maxns} allows "
                         f"about {int(maxns) // 2} sandboxes at once (each takes two)",
                         "`sudo sysctl -w user.max_user_namespaces=15000`", details)
        limit = f" (user.max_user_namespaces={maxns})" if maxns else ""
        return Check("userns", "pass", f"user namespaces work{limit}", details=details)
    cause, fix = diagnose_userns(host, probe)
    if sandbox.ok:
        # The doctor's own probe runs in Python; nsbox's helper may be allowed
        # where Python is not (an AppArmor profile for nsbox-create).
        return Check("userns", "pass", f"nsbox's helper can create user namespaces, other programs cannot ({cause})",
                     details=details)
    return Check("userns", "fail", cause, fix, details)


def check_apparmor(host: Host, sandbox: SandboxAttempt) -> Check:
    value = host.sysctl("kernel.apparmor_restrict_unprivileged_userns")
    if value is None:
        return Check("apparmor", "pass", "no AppArmor restriction of user namespaces in this kernel")
    if value == "0":
        return Check("apparmor", "pass", "AppArmor does not restrict user namespaces "
                     "(kernel.apparmor_restrict_unprivileged_userns=0)")
    if sandbox.ok:
        return Check("apparmor", "pass", "AppArmor restricts unprivileged user namespaces, and allows nsbox's")
    return Check("apparmor", "fail", "AppArmor restricts unprivileged user namespaces "
                 "(kernel.apparmor_restrict_unprivileged_userns=1) and no profile allows nsbox's helper "
                 f"({helper_path()})", _apparmor_fix())


def check_seccomp(host: Host, probe: Probe) -> Check:
    mode, filters = host.seccomp_mode()
    ours = "nsbox adds its own deny-list in sandboxes"
    if mode is None:
        return Check("seccomp", "fail", "this kernel has no seccomp filters (CONFIG_SECCOMP_FILTER), so nsbox "
                     "cannot apply its system call deny-list", "use a kernel built with CONFIG_SECCOMP_FILTER=y "
                     "(every major distribution's is)")
    if mode == 0:
        return Check("seccomp", "pass", f"no seccomp filter on this process; {ours}")
    if probe.get("userns") == "ok":
        return Check("seccomp", "pass", f"this process runs under {filters} seccomp filter(s) that allow user "
                     f"namespaces; {ours}", details={"filters": filters})
    if probe.get("userns") == "EPERM" or probe.get("clone3") == "ENOSYS":
        cause, fix = diagnose_userns(host, probe)
        if "seccomp" in cause:
            return Check("seccomp", "fail", cause, fix, {"filters": filters})
    return Check("seccomp", "pass", f"this process runs under {filters} seccomp filter(s); {ours}",
                 details={"filters": filters})


def _proc_overmounts(host: Host) -> list[str]:
    """Mount points inside /proc (masked paths, read-only binds)."""
    from ..plan.procmask import host_proc_covered

    return host_proc_covered(str(host.proc_self / "mountinfo"))


def check_proc(host: Host, probe: Probe) -> Check:
    covered = _proc_overmounts(host)
    details = {"covered": covered}
    result = probe.get("proc")
    if result == "ok":
        return Check("proc", "pass", "a fresh /proc can be mounted in a sandbox", details=details)
    if result is None:
        return Check("proc", "warn", "not tested: no user namespace to test it in", details=details)
    where = f" ({', '.join(covered[:4])}{', ...' if len(covered) > 4 else ''} covered)" if covered else ""
    # nsbox/plan/procmask.py falls back to a bind of the host's /proc, masked the same way.
    return Check("proc", "warn", f"the kernel refuses a fresh /proc in a user namespace ({result}): the host's "
                 f"/proc has masked or read-only paths{where}, as container runtimes set up; sandboxes get a bind "
                 f"of this /proc (masked as usual), which shows this host's processes", UNMASK_PROC_FIX, details)


def check_overlay(host: Host, probe: Probe) -> Check:
    result = probe.get("overlay")
    layers = _state_parent()
    fs = hostcheck.fs_type(str(layers)) or "?"
    etc = "memory" if etc_upper_in_memory() else "disk"
    details = {"state_dir": str(layers), "fs": fs, "etc_upper": etc}
    if result == "ok":
        return Check("overlay", "pass", f"overlayfs works in a user namespace, on {fs} ({layers}); what a "
                     f"sandbox writes to /etc is kept {'in memory' if etc == 'memory' else 'on disk'}",
                     details=details)
    if result is None:
        return Check("overlay", "warn", "not tested: no user namespace to test it in", details=details)
    version = _kernel_version(host.kernel_release)
    if version is not None and version < (5, 11):
        return Check("overlay", "fail", f"overlayfs cannot be mounted in a user namespace before Linux 5.11 "
                     f"(this is {host.kernel_release}) ({result})", "upgrade the kernel", details)
    if fs.split(".")[0] in hostcheck.NO_UPPER:
        return Check("overlay", "fail", f"the sandboxes' writable layers would be on {fs} ({layers}), which "
                     f"overlayfs cannot use ({result})",
                     "set NSBOX_STATE_DIR to a directory of yours on a local disk, e.g. `export NSBOX_STATE_DIR=$(mktemp -d)` (a fixed name under /tmp can be taken by another user first)",
                     details)
    return Check("overlay", "fail", f"overlayfs in a user namespace failed on {fs} ({layers}): {result}",
                 "check that the kernel has overlayfs (CONFIG_OVERLAY_FS) or set NSBOX_STATE_DIR to a local disk",
                 details)


def _setid_ok(path: str) -> bool:
    """newuidmap must be setuid root or carry file capabilities."""
    try:
        st = os.stat(path)
        if st.st_uid == 0 and st.st_mode & stat.S_ISUID:
            return True
        return bool(os.getxattr(path, "security.capability"))
    except OSError:
        return False


def check_idmap() -> Check:
    from ..host import idmap
    try:
        m = idmap.detect()
    except Exception as e:  # noqa: BLE001 - reported as the check's failure
        return Check("idmap", "fail", str(e), getattr(e, "hint", None))
    details = {"mode": m.mode, "uid_map": [list(x) for x in m.uid_map]}
    if m.mode == "single":
        return Check("idmap", "warn", f"single-uid mode: {m.reason.split(';')[0]}. Only root exists inside a "
                     "sandbox: exec(user=...), su, adduser and a non-root default user are not available",
                     SUBUID_HINT, details)
    if m.mode == "subuid":
        broken = [t for t in idmap.SUBID_HELPERS if not _setid_ok(idmap._find(t) or t)]
        if broken:
            return Check("idmap", "fail", f"{' and '.join(broken)} is neither setuid root nor has file "
                         "capabilities, so it cannot write the id maps",
                         "reinstall it (Debian: `apt-get install --reinstall uidmap`)", details)
    return Check("idmap", "pass", f"{m.mode} mode: {m.reason}", details=details)


def _runtime_dir_problem(value: str) -> str | None:
    if not os.path.isabs(value):
        return "is not an absolute path"
    try:
        st = os.stat(value)
    except OSError as e:
        return f"cannot be used ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you"
    if st.st_mode & 0o077:
        return "is open to other users"
    return None


def check_state_dirs() -> Check:
    from ..host import dirs
    from ..errors import NsboxError
    try:
        runtime = dirs.runtime_dir()
        dirs.data_dir()
        dirs.cache_dir()
    except NsboxError as e:
        return Check("state", "fail", e.message, e.hint)
    details = {"runtime_dir": str(runtime)}
    value = os.environ.get("XDG_RUNTIME_DIR")
    if value is None:
        return Check("state", "pass", f"XDG_RUNTIME_DIR is unset; nsbox keeps its runtime state in {runtime}",
                     details=details)
    problem = _runtime_dir_problem(value)
    if problem:
        return Check("state", "warn", f"XDG_RUNTIME_DIR={value} {problem} (as in a SLURM job that "
                     f"pam_slurm_adopt let in without a systemd user session); nsbox uses {runtime} instead",
                     "unset XDG_RUNTIME_DIR, or point it at a private directory of yours (mode 0700); "
                     "on SLURM, `export XDG_RUNTIME_DIR=$(mktemp -d)` in the job script", details)
    return Check("state", "pass", f"runtime state in {runtime}", details=details)


def check_nofile() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    usable = hard if hard != resource.RLIM_INFINITY else 1 << 20
    details = {"soft": soft, "hard": hard}
    fix = ("raise the hard limit: `ulimit -Hn 65536` in a root shell before dropping privileges, `LimitNOFILE=` "
           "in a systemd unit, `nofile` in /etc/security/limits.conf; on SLURM, `--propagate=NOFILE` or "
           "PropagateResourceLimits")
    summary = f"RLIMIT_NOFILE is {soft} soft / {hard} hard; nsbox raises the soft limit to the hard one"
    if usable < NOFILE_FAIL:
        return Check("nofile", "fail", f"{summary}: too few descriptors to run sandboxes", fix, details)
    if usable < NOFILE_WARN:
        return Check("nofile", "warn", f"{summary}: about {usable // FDS_PER_SANDBOX} sandboxes at once per process",
                     fix, details)
    return Check("nofile", "pass", f"{summary} (about {usable // FDS_PER_SANDBOX} sandboxes per process)",
                 details=details)


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
    out = []
    try:
        for line in (host.proc_self / "mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fstype, _source, opts = (right.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, opts.split(",")))
    except (OSError, IndexError):
        pass
    return out


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


def _short(how: str) -> str:
    if how.startswith("cgroup"):
        return " ".join(how.split()[:2])
    return how.split(" (")[0].replace("approximated by ", "") + ("" if how.startswith("not") else " (approximate)")


def check_limits(host: Host) -> Check:
    support = limit_support(host)
    details = {"cgroup": support.cgroup, "where": support.where, "how": dict(support.how)}
    listing = ", ".join(f"{k}: {_short(v) if k != 'disk' else 'tmpfs layer'}" for k, v in support.how.items())
    missing = [k for k in ("memory", "pids_limit", "cpus") if k not in support.enforced]
    if not missing:
        return Check("limits", "pass", f"limits enforced: {listing}", details=details)
    unbounded = ("; without a memory cgroup, memory= cannot bound memfd or SysV shared memory, pipe or socket "
                 "buffers or kernel memory" if "memory" in missing else "")
    return Check("limits", "warn", f"no cgroup for {', '.join(missing)}; {listing}{unbounded}; strict_limits "
                 "refuses a limit no cgroup enforces", cgroup_fix(host), details)


def cgroup_fix(host: Host) -> str:
    """How to get cgroups nsbox may use, on this host."""
    unified = any(fstype == "cgroup2" and mp == "/sys/fs/cgroup" for mp, fstype, _ in _cgroup_mounts(host))
    if unified:
        return ("run nsbox in a delegated cgroup: in a systemd user session, "
                "`systemd-run --user --scope -p Delegate=yes nsbox ...` (`loginctl enable-linger $USER` keeps "
                "one without a login)")
    return ("this host mounts cgroup v1, which cannot be delegated to an unprivileged user: run nsbox as root, "
            "or boot with the unified hierarchy (systemd.unified_cgroup_hierarchy=1) and a systemd user session")


def check_network(host: Host) -> Check:
    helpers = [t for t in ("pasta", "slirp4netns") if shutil.which(t)]
    details: dict[str, object] = {"helpers": helpers}
    problems, fixes = [], []
    try:
        st = os.stat(host.tun)
        details["tun_mode"] = oct(stat.S_IMODE(st.st_mode))
        if not stat.S_ISCHR(st.st_mode):
            problems.append(f"{host.tun} is not a device")
            fixes.append("`sudo modprobe tun`")
        elif not os.access(host.tun, os.R_OK | os.W_OK):
            problems.append(f"{host.tun} is not open to you (mode {oct(stat.S_IMODE(st.st_mode))[2:]})")
            fixes.append(f"`sudo chmod 0666 {host.tun}` (the usual mode: opening it grants nothing without "
                         "CAP_NET_ADMIN in a network namespace)")
    except OSError:
        problems.append(f"no {host.tun}")
        fixes.append("`sudo modprobe tun` (in a container: pass the device, e.g. `--device /dev/net/tun`)")
    if not helpers:
        problems.append("neither pasta nor slirp4netns is installed")
        fixes.append("`apt-get install passt` (or slirp4netns)")
    if problems:
        return Check("network", "warn", f"network modes none and host work (and proxy); nat will not: {'; '.join(problems)}",
                     "; ".join(fixes), details)
    used = os.environ.get("NSBOX_USERNET_TOOL") if os.environ.get("NSBOX_USERNET_TOOL") in helpers else helpers[0]
    details["nat_tool"] = used
    return Check("network", "pass", f"/dev/net/tun is usable; nat uses {used}"
                 + (f" ({' and '.join(h for h in helpers if h != used)} also installed)" if len(helpers) > 1 else ""),
                 details=details)


def check_sandbox(attempt: SandboxAttempt) -> Check:
    if attempt.ok:
        return Check("sandbox", "pass", attempt.message)
    return Check("sandbox", "fail", f"creating a sandbox failed: {attempt.message}")


def explain_clone_failure(err: int, host: Host | None = None) -> HostPrerequisiteError | None:
    """The error for a failed clone of a sandbox's namespaces, naming the
    cause that probing finds; None if user namespaces work here after all
    (the caller keeps its own message then). For hostcheck.clone_failed, on
    EPERM, EACCES, ENOSPC, EUSERS and ENOSYS (clone3 under Docker's profile)."""
    host = host or Host()
    probe = (host.probe or probe_namespaces)()
    if probe.get("userns") == "ok" and probe.get("idmap") == "ok":
        return None
    cause, fix = diagnose_userns(host, probe)
    return HostPrerequisiteError(f"creating the sandbox's namespaces failed: {os.strerror(err)}: {cause}", fix)


def run_checks(host: Host | None = None) -> list[Check]:
    host = host or Host()
    probe = (host.probe or probe_namespaces)()
    sandbox = (host.sandbox or try_sandbox)()
    return [
        check_kernel(host),
        check_userns(host, probe, sandbox),
        check_apparmor(host, sandbox),
        check_seccomp(host, probe),
        check_proc(host, probe),
        check_overlay(host, probe),
        check_idmap(),
        check_state_dirs(),
        check_nofile(),
        check_limits(host),
        check_network(host),
        check_sandbox(sandbox),
    ]


def helper_path() -> Path:
    return Path(__file__).resolve().parent.parent / "nsbox-create"


def apparmor_profile_text() -> str:
    """contrib/apparmor/nsbox, for this installation's nsbox-create."""
    path = str(helper_path())
    if any(c in path for c in ' "{}[]*?,^'):
        path = '"' + path.replace('"', '\\"') + '"'
    return f"""# AppArmor profile for nsbox's namespace helper (see contrib/apparmor/nsbox).
# Install as root:
#   tee /etc/apparmor.d/nsbox < this-file && apparmor_parser -r /etc/apparmor.d/nsbox
abi <abi/4.0>,
include <tunables/global>

profile nsbox-create {path} flags=(unconfined) {{
  userns,

  # Site-specific additions and overrides. See local/README for details.
  include if exists <local/nsbox-create>
}}
"""


# ---- the command -------------------------------------------------------

MARK = {"pass": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "red")}


def render(checks: list[Check], color: bool) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        word, colour = MARK[c.status]
        mark = click.style(f"{word:>4}", fg=colour, bold=c.status == "fail") if color else f"{word:>4}"
        lines.append(f"{mark}  {c.name:<{width}}  {c.summary}")
        if c.fix and c.status != "pass":
            lines.append(f"      {'':<{width}}  fix: {c.fix}")
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    if failed:
        lines.append(f"nsbox cannot run here: {', '.join(failed)} failed.")
    else:
        extra = f" ({len(warned)} warning{'s' * (len(warned) != 1)}: {', '.join(warned)})" if warned else ""
        lines.append(f"nsbox can run here{extra}.")
    return "\n".join(lines)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--apparmor-profile", is_flag=True,
              help="Print an AppArmor profile that lets this installation's helper create user namespaces.")
def doctor(as_json: bool, apparmor_profile: bool) -> None:
    """Check whether nsbox can run on this host, and what it can enforce.

    Exits with status 1 when a check fails (nsbox cannot run here).
    """
    if apparmor_profile:
        click.echo(apparmor_profile_text(), nl=False)
        return
    checks = run_checks()
    ok = all(c.status != "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": ok, "checks": [c.to_dict() for c in checks]}, indent=2))
    else:
        click.echo(render(checks, color=sys.stdout.isatty()))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    doctor()
