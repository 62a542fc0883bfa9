"""Turning a failed clone or setup step into an error that names the fix.

A bare "Operation not permitted" from clone or mount says nothing about
what to do. The usual causes on real hosts are known: user namespaces
disabled by a sysctl, Ubuntu's AppArmor restriction, a container runtime's
seccomp profile or masked /proc, an overlayfs upper layer on NFS, an old
kernel. Each gets its own message.
"""

from __future__ import annotations

import errno
import os
import platform

from ..plan.steps import Kind, Step
from ..errors import HostPrerequisiteError, SandboxSetupError

# Filesystems overlayfs cannot use for its upper layer (network and FUSE).
NO_UPPER = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse")


def _sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name.replace('.', '/')}") as f:
            return f.read().strip()
    except OSError:
        return None


def _in_container() -> str | None:
    if os.path.exists("/.dockerenv"):
        return "Docker"
    if os.path.exists("/run/.containerenv"):
        return "Podman"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "Kubernetes"
    return None


def _apparmor_hint() -> str | None:
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return ("this host restricts unprivileged user namespaces with AppArmor "
                "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10+): "
                "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`, "
                "or install an AppArmor profile that grants `userns` to this Python")
    return None


def userns_hint() -> str:
    """The most likely reason this host refuses unprivileged user namespaces."""
    if _sysctl("kernel.unprivileged_userns_clone") == "0":
        return "enable them: `sudo sysctl -w kernel.unprivileged_userns_clone=1`"
    if _sysctl("user.max_user_namespaces") == "0":
        return "enable them: `sudo sysctl -w user.max_user_namespaces=15000`"
    apparmor = _apparmor_hint()
    if apparmor:
        return apparmor
    runtime = _in_container()
    if runtime == "Kubernetes":
        return ("inside a Kubernetes pod the default seccomp profile blocks them: "
                "set `securityContext.seccompProfile.type: Unconfined` on the pod")
    if runtime:
        return (f"inside a {runtime} container the default seccomp profile blocks them: "
                "run it with `--security-opt seccomp=unconfined` (or a profile that allows clone with CLONE_NEWUSER)")
    return "check that the kernel has user namespaces enabled (CONFIG_USER_NS) and that no security module blocks them"


def clone_failed(err: int) -> HostPrerequisiteError:
    if err in (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EUSERS, errno.ENOSYS):
        # Probing says which of the possible causes it is (nsbox doctor's
        # checks); its own message stands if user namespaces work after all.
        from ..cli.doctor import explain_clone_failure

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


def fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding `path` (from mountinfo)."""
    real = os.path.realpath(path)
    best, best_type = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, right.split()[0]
    except (OSError, IndexError):
        return None
    return best_type


def _kernel_older_than(major: int, minor: int) -> bool:
    try:
        parts = platform.release().split(".")
        return (int(parts[0]), int(parts[1].split("-")[0])) < (major, minor)
    except (ValueError, IndexError):
        return False


def step_failed(step: Step, err: int, layer: str) -> SandboxSetupError | HostPrerequisiteError:
    """The error for a setup step that failed with `err`."""
    what = f"sandbox setup failed: {step.what}: {os.strerror(err)}"
    denied = err in (errno.EPERM, errno.EACCES)
    if denied and _apparmor_hint():
        return HostPrerequisiteError(what, _apparmor_hint())
    if err == errno.ENOSYS:
        return HostPrerequisiteError(what, "this kernel lacks the new mount API; nsbox needs Linux 5.12 or later")
    if step.kind == Kind.MOUNT and step.c == "proc" and denied:
        return HostPrerequisiteError(
            what + " (the host's /proc has paths masked by over-mounts, so the kernel refuses a new procfs)",
            "inside a container, unmask /proc: Docker `--security-opt systempaths=unconfined`, "
            "Kubernetes `securityContext.procMount: Unmasked`",
        )
    if step.kind == Kind.MOUNT and step.c == "overlay":
        fs = fs_type(layer)
        if fs and fs.split(".")[0] in NO_UPPER:
            return SandboxSetupError(
                what + f" (the writable layer {layer} is on {fs}, which overlayfs cannot use as an upper layer)",
                "set NSBOX_STATE_DIR to a directory of yours on a local disk, e.g. `export NSBOX_STATE_DIR=$(mktemp -d)` (a fixed name under /tmp can be taken by another user first)",
            )
        if _kernel_older_than(5, 11):
            return HostPrerequisiteError(what, f"overlayfs in a user namespace needs Linux 5.11 or later "
                                               f"(this is {platform.release()})")
        if denied:
            return SandboxSetupError(what, "every directory of the root filesystem must be readable by you; "
                                           "check the permissions of the rootfs directory")
    return SandboxSetupError(what)
