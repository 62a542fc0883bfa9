"""The seccomp deny-list (csrc/init/seccomp.c), exercised for real.

tests/seccomp_probe.c is linked statically with the filter, as setup.py
links the init, and makes every denied call (with harmless arguments) and
a list of operations that must keep working. Each is run with the filter
and without it: without it every denied call reaches the kernel (it
succeeds, or fails with an error other than the filter's), so the EPERM
seen with it is the filter's doing. The filter is installed the way the
init installs it on itself: as root of a user namespace (--userns),
without no_new_privs; and, as a second check, in a plain process with
no_new_privs.

The filter program is also checked instruction by instruction for x86_64
and for aarch64 (built with a cross compiler, run under qemu-user) against
libseccomp's syscall tables, which nsbox does not otherwise use.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nsbox.create import zygote

from tests import components

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parents[1]

# Probes of calls the filter denies, whatever the mode.
ALWAYS_DENIED = [
    "keyctl", "keyctl_real", "add_key", "request_key", "bpf", "perf_event_open", "perf_event_open_real",
    "userfaultfd", "userfaultfd_real", "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "quotactl", "quotactl_fd",
    "swapon", "swapoff", "reboot", "syslog", "open_by_handle_at", "tiocsti_real", "tiocsti_highbits",
    "tioclinux",
]
ARCH_SPECIFIC = ["lookup_dcookie", "uselib", "iopl", "ioperm"]  # where the architecture has them
# Denied unless nested sandboxes are allowed (clone3: ENOSYS).
NAMESPACE_DENIED = [
    "setns", "setns_init_user", "setns_init_mnt", "setns_init_swapped", "setns_init_anytype", "mount", "mount_real", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "open_tree_attr", "unshare_user_real", "unshare_user_highbits",
    "unshare_mnt_real", "unshare_net_real", "unshare_time_real", "clone_user_real", "clone_net_real",
]
FOREIGN_ABI = ["x32_abi", "i386_abi"]
ALLOWED = [
    "fork_exec", "posix_spawn", "thread", "vfork", "clone_plain", "unshare_fs_files", "files", "memory",
    "pty_job_control", "creds", "setgroups", "sockets", "events", "ptrace", "own_filter",
]
# Calls the kernel refuses (EPERM) to anyone without the capability in the
# initial user namespace: without the filter they tell nothing unless run
# as real root outside any user namespace.
INITIAL_NS_CAPABILITY = {"acct", "swapoff", "reboot", "syslog", "kexec_load", "kexec_file_load", "init_module",
                         "finit_module", "delete_module", "iopl", "ioperm", "lookup_dcookie", "uselib"}
SIGSYS = "signal:31"


def _installed_from() -> Path | None:
    """The source tree this nsbox was pip-installed from (tests/run.sh runs
    a staged copy of tests/ with nsbox installed from the checkout)."""
    try:
        text = importlib.metadata.distribution("nsbox").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(text or "{}").get("url", "")
    return Path(url.removeprefix("file://")) if url.startswith("file://") else None


def source_dir() -> Path:
    """The checkout's csrc/ directory."""
    for root in (os.environ.get("NSBOX_SOURCE_DIR"), TESTS.parent, _installed_from()):
        if root and (Path(root) / "csrc" / "init" / "seccomp.c").is_file():
            return Path(root) / "csrc"
    pytest.skip("nsbox's C sources (csrc/init/seccomp.c) are not reachable from here; set NSBOX_SOURCE_DIR")


def native_cc() -> list[str]:
    """This machine's C compiler, as setup.py finds it."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def compile_probe(dest: Path, cc: list[str] | None = None) -> Path:
    """Links tests/seccomp_probe.c with csrc/init/seccomp.c, statically, as setup.py builds the init."""
    csrc = source_dir()
    cc = cc or native_cc()
    cmd = [*cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-static", f"-I{csrc}", "-o", str(dest),
           str(TESTS / "seccomp_probe.c"), str(csrc / "init" / "seccomp.c")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return dest


@pytest.fixture(scope="session")
def probe_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_probe(tmp_path_factory.mktemp("seccomp") / "seccomp_probe")


def run_probe(binary: Path, *args: str) -> dict[str, str]:
    r = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(line.split(" ", 1) for line in r.stdout.splitlines())


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def _present(results: dict[str, str], names: list[str]) -> list[str]:
    return [n for n in names if n in results]


# The filter installed as the init will (root of a user namespace, no
# no_new_privs), and in a plain process with no_new_privs.
CONTEXTS = {"userns": ["--userns"], "no_new_privs": ["--nnp"]}


@pytest.fixture(scope="module", params=list(CONTEXTS))
def context(request: pytest.FixtureRequest) -> list[str]:
    return CONTEXTS[request.param]


@pytest.fixture(scope="module")
def unfiltered(probe_binary: Path) -> dict[str, str]:
    return run_probe(probe_binary, "--userns", "none")


def test_denied_calls_fail_with_eperm(probe_binary: Path, context: list[str]) -> None:
    results = run_probe(probe_binary, *context, "default")
    for name in ALWAYS_DENIED + _present(results, ARCH_SPECIFIC) + NAMESPACE_DENIED:
        assert results[name] == "EPERM", f"{name}: {results[name]}"
    # clone3's flags cannot be inspected: ENOSYS sends the C library to clone.
    assert results["clone3_user_real"] == "ENOSYS"


def test_tiocsti_refused_on_a_terminal_the_process_owns(probe_binary: Path, unfiltered: dict[str, str]) -> None:
    # Without the filter, pushing input into our own controlling terminal
    # works (unless the kernel's dev.tty.legacy_tiocsti switch is off).
    expected = "EIO" if _sysctl("dev.tty.legacy_tiocsti") == "0" else "ok"
    assert unfiltered["tiocsti_real"] == expected
    # The kernel reads ioctl's cmd as 32 bits: TIOCSTI | 1 << 32 is TIOCSTI,
    # and the filter compares the low 32 bits only.
    assert unfiltered["tiocsti_highbits"] == expected
    results = run_probe(probe_binary, "--userns", "default")
    assert results["tiocsti_real"] == results["tiocsti_highbits"] == "EPERM"
    assert results["tioclinux"] == "EPERM"


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86_64 ABIs")
def test_other_abis_are_killed(probe_binary: Path, context: list[str], unfiltered: dict[str, str]) -> None:
    results = run_probe(probe_binary, *context, "default")
    # x32 calls are refused even by kernels built with x32 support.
    assert results["x32_abi"] == SIGSYS
    if unfiltered["i386_abi"] == "ok":  # the kernel runs i386 calls (IA32 emulation on)
        assert results["i386_abi"] == SIGSYS
    nested = run_probe(probe_binary, *context, "nested")
    assert nested["x32_abi"] == SIGSYS
    if unfiltered["i386_abi"] == "ok":
        assert nested["i386_abi"] == SIGSYS


def test_allowed_operations_keep_working(probe_binary: Path, context: list[str]) -> None:
    plain = run_probe(probe_binary, *context, "none")
    filtered = run_probe(probe_binary, *context, "default")
    for name in ALLOWED:
        # setgroups needs CAP_SETGID, and a user namespace of ours has
        # setgroups "deny": the kernel may refuse it, filter or not.
        if name != "setgroups":
            assert plain[name] == "ok", f"{name}: {plain[name]} without the filter"
        assert filtered[name] == plain[name], f"{name}: {filtered[name]} with the filter, {plain[name]} without"


def test_nested_mode_allows_namespaces_and_nothing_else(probe_binary: Path, unfiltered: dict[str, str]) -> None:
    nested = run_probe(probe_binary, "--userns", "nested")
    for name in NAMESPACE_DENIED + ["clone3_user_real"]:
        assert nested[name] == unfiltered[name], f"{name}: {nested[name]} nested, {unfiltered[name]} unfiltered"
    assert nested["unshare_user_real"] == nested["clone3_user_real"] == nested["mount_real"] == "ok"
    for name in ALWAYS_DENIED + _present(nested, ARCH_SPECIFIC):
        assert nested[name] == "EPERM", name
    for name in ALLOWED:
        assert nested[name] == unfiltered[name], name


def test_init_mode_allows_the_inits_two_setns_calls_and_nothing_else(
        probe_binary: Path, unfiltered: dict[str, str]) -> None:
    """The filter as the init carries it: its children may join the
    sandbox's namespaces through its two descriptors, with the right type."""
    init = run_probe(probe_binary, "--userns", "init")
    default = run_probe(probe_binary, "--userns", "default")
    # The kernel's own answers: re-entering our user namespace is EINVAL,
    # re-entering our mount namespace works.
    assert unfiltered["setns_init_user"] == init["setns_init_user"] == "EINVAL"
    assert unfiltered["setns_init_mnt"] == init["setns_init_mnt"] == "ok"
    # The other number, or any namespace type: the kernel would take them.
    for name in ("setns_init_swapped", "setns_init_anytype"):
        assert unfiltered[name] == "ok" and init[name] == "EPERM", name
    allowed = {"setns_init_user", "setns_init_mnt"}
    assert {k: v for k, v in init.items() if k not in allowed} == {
        k: v for k, v in default.items() if k not in allowed}


def test_without_the_filter_each_call_reaches_the_kernel(probe_binary: Path, unfiltered: dict[str, str]) -> None:
    """The protection switched off: the same probes are not refused."""
    # What an unprivileged process may really do, and does, without the filter.
    real = ["keyctl_real", "userfaultfd_real", "unshare_user_real", "unshare_mnt_real", "unshare_net_real",
            "unshare_time_real", "clone_user_real", "clone_net_real", "clone3_user_real", "mount_real"]
    paranoid = _sysctl("kernel.perf_event_paranoid")
    if paranoid is not None and int(paranoid) <= 2:
        real.append("perf_event_open_real")
    for name in real:
        assert unfiltered[name] == "ok", f"{name}: {unfiltered[name]}"
    # The rest fail, but with the kernel's own error, not EPERM.
    for name in ALWAYS_DENIED + _present(unfiltered, ARCH_SPECIFIC) + NAMESPACE_DENIED:
        if name not in INITIAL_NS_CAPABILITY:
            assert unfiltered[name] != "EPERM", f"{name}: EPERM without the filter"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs real root: the capability-gated calls")
def test_without_the_filter_root_reaches_every_call(probe_binary: Path) -> None:
    results = run_probe(probe_binary, "none")  # real root, initial user namespace
    for name in ALWAYS_DENIED + _present(results, ARCH_SPECIFIC) + NAMESPACE_DENIED:
        assert results[name] != "EPERM", f"{name}: EPERM without the filter"


PYTHON_WORKLOAD = r"""
import asyncio, os, socket, subprocess, tempfile, threading
# Threads (glibc tries clone3 first), subprocesses (posix_spawn, vfork),
# a pipeline, files, a server on the loopback: what Inspect's tools do.
out = []
t = threading.Thread(target=lambda: out.append(1)); t.start(); t.join()
assert subprocess.run(["sh", "-c", "echo hi | tr h H"], capture_output=True, text=True).stdout == "Hi\n"
pid = os.posix_spawn("/bin/true", ["true"], os.environ); assert os.waitpid(pid, 0)[1] == 0
with tempfile.NamedTemporaryFile("w+") as f:
    f.write("data"); f.flush(); assert open(f.name).read() == "data"
async def main():
    async def handle(r, w):
        w.write(await r.readline()); await w.drain(); w.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"ping\n"); await w.drain()
    assert await r.readline() == b"ping\n"
    server.close()
asyncio.run(main())
# And what stays refused, seen from Python.
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000) == -1 and ctypes.get_errno() == errno.EPERM
print("workload-ok")
"""


def test_python_workload_under_the_filter(probe_binary: Path) -> None:
    r = subprocess.run([str(probe_binary), "--userns", "default", "--", sys.executable, "-c", PYTHON_WORKLOAD],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "workload-ok", r.stderr


SHELL_SESSION = r"""
import os, pty, sys, time
pid, fd = pty.fork()
if pid == 0:
    os.execvp("bash", ["bash", "--norc", "--noprofile", "-i"])
# A job stopped with ^Z, listed, resumed in the foreground: job control
# needs the terminal's process-group ioctls.
for line in [b"sleep 2\n", b"\x1a", b"jobs\n", b"fg\n", b"echo job-control-$((20+22))\n", b"exit\n"]:
    os.write(fd, line); time.sleep(0.3)
out = b""
while True:
    try:
        chunk = os.read(fd, 4096)
    except OSError:
        break
    if not chunk:
        break
    out += chunk
os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace"))
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_interactive_shell_job_control_under_the_filter(probe_binary: Path) -> None:
    r = subprocess.run([str(probe_binary), "--userns", "default", "--", sys.executable, "-c", SHELL_SESSION],
                       capture_output=True, text=True, timeout=60)
    assert "job-control-42" in r.stdout, r.stdout + r.stderr
    assert "Stopped" in r.stdout and "no job control" not in r.stdout, r.stdout


# ---- the program, for each architecture, against libseccomp's tables -------

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
FOREIGN_ARCH = {"x86_64": 0x40000003, "aarch64": 0x40000028}  # i386, 32-bit ARM
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38
TIOCSTI, TIOCLINUX, TCGETS = 0x5412, 0x541C, 0x5401
CLONE_NEWUSER, CLONE_NEWNET, CLONE_VM, CLONE_FS = 0x10000000, 0x40000000, 0x100, 0x200
CLONE_NEWNS = 0x20000
FD_USERNS, FD_MNTNS = zygote.lib.NSBOX_FD_USERNS, zygote.lib.NSBOX_FD_MNTNS
# Filter entries by syscall name (libseccomp names), and numbers libseccomp
# 2.5 does not know yet (calls added since have one number everywhere).
DENIED_NAMES = ["keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
                "finit_module", "delete_module", "acct", "quotactl", "quotactl_fd", "swapon", "swapoff",
                "reboot", "syslog", "open_by_handle_at", "lookup_dcookie", "uselib", "iopl", "ioperm"]
NAMESPACE_NAMES = ["setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
                   "fsmount", "fspick", "mount_setattr", "open_tree_attr"]
UNIFIED = {"open_tree_attr": 467}
ALLOWED_NAMES = ["read", "write", "openat", "close", "execve", "mmap", "ptrace", "setresuid", "setgroups",
                 "chdir", "socket", "bind", "prctl", "seccomp", "wait4", "exit_group", "pidfd_open"]


def _resolver() -> str:
    components.require("seccomp")
    return components.which("scmp_sys_resolver") or "scmp_sys_resolver"


def syscall_number(arch: str, name: str) -> int | None:
    r = subprocess.run([_resolver(), "-a", arch, name], capture_output=True, text=True)
    n = int(r.stdout.strip()) if r.returncode == 0 else -1
    if n < 0:
        return UNIFIED.get(name)  # negative: not a system call of this architecture
    return n


class Bpf:
    """A classic BPF interpreter for the instructions a seccomp filter uses."""

    def __init__(self, text: str) -> None:
        self.insns = [tuple(int(x) for x in line.split()) for line in text.splitlines()]
        assert self.insns, "empty filter"

    def run(self, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
        args = args + (0,) * (6 - len(args))
        words = {0: nr, 4: arch}
        for i, a in enumerate(args):
            words[16 + 8 * i] = a & 0xFFFFFFFF
            words[20 + 8 * i] = a >> 32
        acc, pc = 0, 0
        while True:
            code, jt, jf, k = self.insns[pc]
            if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
                acc = words[k]
                pc += 1
            elif code in (0x15, 0x35, 0x45):  # BPF_JMP | JEQ / JGE / JSET, with K
                taken = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
                pc += 1 + (jt if taken else jf)
            elif code == 0x06:  # BPF_RET | BPF_K
                return k
            else:
                raise AssertionError(f"unexpected instruction {code:#x} at {pc}")

    def singled_out(self, arch: int) -> set[int]:
        """The system call numbers (below 1024) for which the program
        returns anything but ALLOW, with zero arguments or with every
        namespace flag and TIOCSTI in them."""
        flags = 0x7E020080
        return {nr for nr in range(1024)
                if self.run(arch, nr) != RET_ALLOW or self.run(arch, nr, (flags, TIOCSTI)) != RET_ALLOW}


def toolchain(arch: str) -> tuple[list[str], list[str]]:
    """The compiler for `arch` and what runs its programs here (nothing
    for this machine's; qemu-user for another); skips the test if they
    are missing."""
    if arch == os.uname().machine:
        return native_cc(), []
    cc, qemu = f"{arch}-linux-gnu-gcc", f"qemu-{arch}"
    if arch == "aarch64":
        components.require("aarch64")
    if not shutil.which(cc) or not shutil.which(qemu):
        pytest.skip(f"needs {cc} and {qemu} (Debian: gcc-{arch}-linux-gnu, qemu-user)")
    return [cc], [qemu]


def _dump(arch: str, tmp: Path, mode: str) -> Bpf:
    cc, runner = toolchain(arch)
    binary = compile_probe(tmp / f"probe-{arch}", cc)
    r = subprocess.run([*runner, str(binary), "--dump", mode], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return Bpf(r.stdout)


@pytest.mark.once  # the filter's program, compiled and dumped: no sandbox
@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_filter_program_per_architecture(arch: str, tmp_path: Path) -> None:
    nr = {name: syscall_number(arch, name) for name in
          DENIED_NAMES + NAMESPACE_NAMES + ALLOWED_NAMES + ["ioctl", "clone", "clone3", "unshare"]}
    present = {name: n for name, n in nr.items() if n is not None}
    native, foreign = AUDIT_ARCH[arch], FOREIGN_ARCH[arch]
    eperm, enosys = RET_ERRNO | EPERM, RET_ERRNO | ENOSYS
    for mode in ("default", "nested", "init"):
        prog = _dump(arch, tmp_path, mode)
        nested = mode == "nested"
        # Exactly these numbers are singled out, no more, no fewer.
        expected = {present[n] for n in DENIED_NAMES + ["ioctl"] if n in present}
        if not nested:
            expected |= {present[n] for n in NAMESPACE_NAMES + ["clone", "clone3", "unshare"] if n in present}
        assert prog.singled_out(native) == expected
        for name in DENIED_NAMES:
            if name in present:
                assert prog.run(native, present[name]) == eperm, name
        for name in NAMESPACE_NAMES:
            if name in present:
                assert prog.run(native, present[name]) == (RET_ALLOW if nested else eperm), name
        for name in ALLOWED_NAMES:
            assert prog.run(native, present[name]) == RET_ALLOW, name
        assert prog.run(native, present["clone3"]) == (RET_ALLOW if nested else enosys)
        for call in ("clone", "unshare"):
            assert prog.run(native, present[call], (CLONE_NEWUSER,)) == (RET_ALLOW if nested else eperm)
            assert prog.run(native, present[call], (CLONE_NEWNET | 1 << 32,)) == (RET_ALLOW if nested else eperm)
            assert prog.run(native, present[call], (CLONE_VM | CLONE_FS,)) == RET_ALLOW
        ioctl = present["ioctl"]
        for cmd in (TIOCSTI, TIOCLINUX, TIOCSTI | 1 << 32, TIOCSTI | 0xFFFF_FFFF << 32):
            assert prog.run(native, ioctl, (0, cmd)) == eperm, hex(cmd)
        assert prog.run(native, ioctl, (0, TCGETS)) == RET_ALLOW
        # The init's two setns calls; the kernel reads fd and type as int.
        setns = present["setns"]
        for args in ((FD_USERNS, CLONE_NEWUSER), (FD_MNTNS, CLONE_NEWNS), (FD_MNTNS | 1 << 32, CLONE_NEWNS)):
            assert prog.run(native, setns, args) == (eperm if mode == "default" else RET_ALLOW), args
        for args in ((FD_USERNS, CLONE_NEWNS), (FD_MNTNS, CLONE_NEWUSER), (FD_MNTNS, 0), (FD_USERNS, 0),
                     (7, CLONE_NEWUSER), (0, CLONE_NEWNS), (FD_USERNS, CLONE_NEWUSER | CLONE_NEWNS)):
            assert prog.run(native, setns, args) == (RET_ALLOW if nested else eperm), args
        # Another ABI's numbers mean other calls: the process is killed.
        assert prog.run(foreign, 0) == RET_KILL_PROCESS
        assert prog.run(foreign, present["read"]) == RET_KILL_PROCESS
        if arch == "x86_64":
            assert prog.run(native, 0x40000000 | present["read"]) == RET_KILL_PROCESS
            assert prog.run(native, 0x40000000 + 512) == RET_KILL_PROCESS


def test_install_reports_errors_instead_of_failing_silently(probe_binary: Path) -> None:
    # Without CAP_SYS_ADMIN and without no_new_privs the kernel refuses the
    # filter; the init must then fail the request, not run unfiltered.
    if os.geteuid() == 0:
        pytest.skip("root may install a filter anywhere")
    r = subprocess.run([str(probe_binary), "default", "--", "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "installing the filter" in r.stderr
