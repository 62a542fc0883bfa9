"""`nsbox doctor`: can nsbox run on this host, and what can it enforce here?

Each check tries the real thing where it can, and reads sysctls and files
only to explain a failure: a child process creates a user namespace,
writes its id maps, mounts a fresh /proc and an overlayfs in it; a sandbox
is created and runs `true`. Every check ends in pass, warn (nsbox runs,
but something is missing or approximated) or fail (nsbox cannot run), with
the fix on one line. `nsbox doctor` exits 1 when a check fails.

Where the doctor looks is a `Host` (nsbox/host/probe.py); tests point it
at fake sysctls and cgroup trees, and replace the two real attempts, to
simulate hosts that cannot be produced here. The namespace probe and the
diagnosis of its result are nsbox/create/hostcheck.py's, which explains a
failed sandbox creation the same way.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import click

from ..create import hostcheck
from ..create.hostcheck import apparmor_fix, diagnose_userns, probe_namespaces, state_parent
from ..host import probe as facts
from ..host.layers import etc_upper_in_memory
from ..host.probe import Host, Probe, SandboxAttempt, cgroup_fix, kernel_version, limit_support

Status = Literal["pass", "warn", "fail"]
MIN_KERNEL = (5, 12)
# A sandbox holds about four descriptors in the process that owns it.
FDS_PER_SANDBOX = 4
NOFILE_FAIL, NOFILE_WARN = 64, 4096
SUBUID_HINT = ("give yourself a subordinate id range and install newuidmap: as root, "
               "`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $USER` and `apt-get install uidmap`")
UNMASK_PROC_FIX = ("inside a container, unmask /proc: Docker and Podman `--security-opt systempaths=unconfined`, "
                   "Kubernetes `securityContext.procMount: Unmasked` (with `hostUsers: false`)")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    summary: str
    fix: str | None = None
    details: Mapping[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "details": dict(self.details)}


# ---- the real attempts -------------------------------------------------

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

def check_kernel(host: Host) -> Check:
    version = kernel_version(host.kernel_release)
    need = ".".join(map(str, MIN_KERNEL))
    if version is None:
        return Check("kernel", "warn", f"cannot tell the kernel version from {host.kernel_release!r}")
    if version < MIN_KERNEL:
        return Check("kernel", "fail", f"Linux {host.kernel_release} is too old: nsbox needs {need} or later "
                     "(openat2, mount_setattr, overlayfs in user namespaces)",
                     "upgrade the kernel (or run nsbox on a newer host)")
    return Check("kernel", "pass", f"Linux {host.kernel_release} ({platform.machine()}; nsbox needs {need}+)")


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
                 f"({helper_path()})", apparmor_fix())


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
    layers = state_parent()
    fs = facts.fs_type(str(layers)) or "?"
    etc = "memory" if etc_upper_in_memory() else "disk"
    details = {"state_dir": str(layers), "fs": fs, "etc_upper": etc}
    if result == "ok":
        return Check("overlay", "pass", f"overlayfs works in a user namespace, on {fs} ({layers}); what a "
                     f"sandbox writes to /etc is kept {'in memory' if etc == 'memory' else 'on disk'}",
                     details=details)
    if result is None:
        return Check("overlay", "warn", "not tested: no user namespace to test it in", details=details)
    version = kernel_version(host.kernel_release)
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
