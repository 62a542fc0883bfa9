"""Turning a failed clone or setup step into an error that names the fix.

A bare "Operation not permitted" from clone or mount says nothing about
what to do. The usual causes on real hosts are known: user namespaces
disabled by a sysctl, Ubuntu's AppArmor restriction, a container runtime's
seccomp profile or masked /proc, an overlayfs upper layer on NFS, an old
kernel. Each gets its own message. Where the failure alone cannot tell,
a probe creates a user namespace as nsbox does (probe_namespaces(), also
`nsbox doctor`'s) and the host's facts (nsbox/host/probe.py) say which
cause it is.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import HostPrerequisiteError, SandboxSetupError
from ..host import probe as facts
from ..host.probe import Host, Probe
from ..plan.overlay import OVERLAY_OPTIONS
from ..plan.steps import Kind, Step

# Filesystems overlayfs cannot use for its upper layer (network and FUSE).
NO_UPPER = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse")
SECCOMP_FIXES = {
    "Docker": "run the container with `--security-opt seccomp=unconfined` "
              "(or a profile that allows unshare and clone with CLONE_NEWUSER)",
    "Podman": "run the container with `--security-opt seccomp=unconfined`",
    "Kubernetes": "set `securityContext.seccompProfile.type: Unconfined` on the pod "
                  "(or a Localhost profile that allows CLONE_NEWUSER)",
}
APPARMOR_FIX = ("let nsbox's helper create them: `{python} -m nsbox.cli.doctor --apparmor-profile | sudo tee "
                "/etc/apparmor.d/nsbox && sudo apparmor_parser -r /etc/apparmor.d/nsbox` "
                "(see contrib/apparmor/nsbox), or lift the restriction for every program: "
                "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`")
USERNS_FIX = "check that the kernel has user namespaces enabled (CONFIG_USER_NS) and that no security module blocks them"


def apparmor_fix() -> str:
    return APPARMOR_FIX.format(python=shlex.quote(sys.executable))


def _seccomp_fix() -> str:
    runtime = facts.in_container()
    if runtime in SECCOMP_FIXES:
        return SECCOMP_FIXES[runtime]
    return ("start nsbox outside the program that installed the filter; in a container: "
            + "; ".join(f"{name}: {fix}" for name, fix in SECCOMP_FIXES.items()))


# ---- the namespace probe ----------------------------------------------

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


def state_parent() -> Path:
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
    work = Path(tempfile.mkdtemp(prefix="doctor-", dir=state_parent()))
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


# ---- the diagnosis -----------------------------------------------------

def diagnose_userns(host: Host, probe: Probe | None = None) -> tuple[str, str]:
    """Why user namespaces fail here, and the fix: (cause, fix).

    `probe`: how far probe_namespaces() got. Without one (nsbox's own helper
    was refused where the probe was not, or nothing was probed), the host's
    settings alone name the likeliest cause."""
    seen = probe or {}
    userns, idmap = seen.get("userns", "?"), seen.get("idmap")
    maxns = host.sysctl("user.max_user_namespaces")
    # Root is exempt from this sysctl; without a probe it is still the likeliest cause.
    if host.sysctl("kernel.unprivileged_userns_clone") == "0" and (host.euid != 0 or probe is None):
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
    if seccomp == 2 and (userns == "EPERM" or seen.get("clone3") == "ENOSYS"):
        pattern = (" (unshare: EPERM, clone3: ENOSYS: Docker's default profile does this)"
                   if userns == "EPERM" and seen.get("clone3") == "ENOSYS" else "")
        return (f"a seccomp filter on this process ({filters} filter(s)) refuses new user namespaces{pattern}",
                _seccomp_fix())
    denied = {"EPERM", "EACCES"}
    if host.sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1" and (
            probe is None or userns in denied or idmap in denied):
        return ("AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1, "
                + "Ubuntu 23.10+): a new namespace gets no capabilities, so its id maps cannot be written",
                apparmor_fix())
    runtime = facts.in_container()
    if probe is None and runtime:
        return f"inside a {runtime} container, whose default seccomp profile refuses them", _seccomp_fix()
    stage = "writing its id maps" if userns == "ok" else "creating it"
    cause = f"creating a user namespace failed ({stage}: {idmap if userns == 'ok' else userns})"
    # The probe named no cause: the host's settings alone may still.
    return cause, (diagnose_userns(host)[1] if probe is not None else USERNS_FIX)


def userns_hint() -> str:
    """The most likely reason this host refuses unprivileged user namespaces."""
    return diagnose_userns(Host())[1]


def explain_clone_failure(err: int, host: Host | None = None) -> HostPrerequisiteError | None:
    """The error for a failed clone of a sandbox's namespaces, naming the
    cause that probing finds; None if user namespaces work here after all
    (the caller keeps its own message then). For clone_failed, on EPERM,
    EACCES, ENOSPC, EUSERS and ENOSYS (clone3 under Docker's profile)."""
    host = host or Host()
    probe = (host.probe or probe_namespaces)()
    if probe.get("userns") == "ok" and probe.get("idmap") == "ok":
        return None
    cause, fix = diagnose_userns(host, probe)
    return HostPrerequisiteError(f"creating the sandbox's namespaces failed: {os.strerror(err)}: {cause}", fix)


# ---- the errors ---------------------------------------------------------

def clone_failed(err: int) -> HostPrerequisiteError:
    if err in (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EUSERS, errno.ENOSYS):
        # Probing says which of the possible causes it is (as nsbox doctor
        # does); its own message stands if user namespaces work after all.
        explained = explain_clone_failure(err)
        if explained is not None:
            return explained
    what = f"creating the sandbox's namespaces failed: {os.strerror(err)}"
    if err in (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EUSERS):
        return HostPrerequisiteError(what + " (unprivileged user namespaces are not available)", userns_hint())
    if err == errno.EINVAL:
        return HostPrerequisiteError(what, "this kernel lacks one of the user, mount, PID, IPC, UTS, "
                                           "cgroup or network namespaces; nsbox needs Linux 5.12 or later")
    return HostPrerequisiteError(what)


def step_failed(step: Step, err: int, layer: str) -> SandboxSetupError | HostPrerequisiteError:
    """The error for a setup step that failed with `err`."""
    what = f"sandbox setup failed: {step.what}: {os.strerror(err)}"
    denied = err in (errno.EPERM, errno.EACCES)
    if denied and facts.sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return HostPrerequisiteError(what, "this host restricts unprivileged user namespaces with AppArmor "
                                           "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10+): "
                                           + apparmor_fix())
    if err == errno.ENOSYS:
        return HostPrerequisiteError(what, "this kernel lacks the new mount API; nsbox needs Linux 5.12 or later")
    if step.kind == Kind.MOUNT and step.c == "proc" and denied:
        return HostPrerequisiteError(
            what + " (the host's /proc has paths masked by over-mounts, so the kernel refuses a new procfs)",
            "inside a container, unmask /proc: Docker `--security-opt systempaths=unconfined`, "
            "Kubernetes `securityContext.procMount: Unmasked`",
        )
    if step.kind == Kind.MOUNT and step.c == "overlay":
        fs = facts.fs_type(layer)
        if fs and fs.split(".")[0] in NO_UPPER:
            return SandboxSetupError(
                what + f" (the writable layer {layer} is on {fs}, which overlayfs cannot use as an upper layer)",
                "set NSBOX_STATE_DIR to a directory of yours on a local disk, e.g. `export NSBOX_STATE_DIR=$(mktemp -d)` (a fixed name under /tmp can be taken by another user first)",
            )
        if facts.kernel_older_than(5, 11):
            return HostPrerequisiteError(what, f"overlayfs in a user namespace needs Linux 5.11 or later "
                                               f"(this is {platform.release()})")
        if denied:
            return SandboxSetupError(what, "every directory of the root filesystem must be readable by you; "
                                           "check the permissions of the rootfs directory")
    return SandboxSetupError(what)
