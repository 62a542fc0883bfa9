"""User-mode networking for the `nat` mode: pasta (preferred) or slirp4netns.

Either program attaches a tap device to the sandbox's network namespace and
turns its traffic into ordinary sockets of the host, so the sandbox gets
outbound TCP, UDP and DNS without any privilege. The layout is the same
with both, so nothing else depends on which one runs:

    sandbox address  10.0.2.100/24 on tap0, default route via 10.0.2.2
    10.0.2.2         the host's loopback (host.nsbox.internal) only with
                     host_loopback=True (opt-in: else nothing answers there)
    10.0.2.3         DNS, forwarded to the host's resolver

The sandbox's own 127.0.0.1 stays its own: pasta's automatic forwarding of
the host's bound ports into the namespace (and of the namespace's ports to
the host) is switched off (-t/-u/-T/-U none), so only the gateway address
reaches the host. Ports are published separately (nsbox.net.ports).

Both programs need /dev/net/tun. `check_tun()` turns an unusable one into
one line naming the fix.

Lifetime: the program runs as a child of the network helper with
PR_SET_PDEATHSIG (set by nsbox-tied, csrc/tied/main.c, before it execs the
program), and the helper kills it when the sandbox's init exits
(given its pidfd), when `UserNet.stop()` is called, and when the nsbox
process goes away. pasta does not quit by itself when a namespace given as
/proc/PID/ns/net disappears (it holds the namespace, so it never does).
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from typing import Literal, Sequence

from .client import NetError, NetHelper, Namespaces, helper

Tool = Literal["pasta", "slirp4netns"]
TOOLS: tuple[Tool, ...] = ("pasta", "slirp4netns")
TUN_DEVICE = "/dev/net/tun"
ADDRESS = "10.0.2.100"
GATEWAY = "10.0.2.2"
DNS = "10.0.2.3"
PREFIX = 24
MTU = 65520
SEARCH_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"
PACKAGES = "install passt (pasta; Debian/Ubuntu: `apt install passt`, Fedora: `dnf install passt`) or slirp4netns"


def find_tool(prefer: Tool | None = None) -> tuple[Tool, str]:
    """The user-mode networking program to use and its path: `prefer` if
    given, else $NSBOX_USERNET_TOOL, else pasta if installed, else slirp4netns."""
    prefer = prefer or os.environ.get("NSBOX_USERNET_TOOL") or None  # type: ignore[assignment]
    for tool in ((prefer,) if prefer else TOOLS):
        path = shutil.which(tool) or shutil.which(tool, path=SEARCH_PATH)
        if path:
            return tool, path
    raise NetError(f"the nat network mode needs {prefer or 'pasta or slirp4netns'}, which is not installed",
                   hint=PACKAGES)


def check_tun(device: str = TUN_DEVICE) -> None:
    """Raises NetError, naming the fix, when this user cannot open the tun device."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            try:
                mode = f"mode {os.stat(device).st_mode & 0o777:04o}"
            except OSError:
                mode = "not accessible"
            raise NetError(
                f"the nat network mode needs {device}, which this user cannot open ({mode})",
                hint=f"have an administrator run `chmod 0666 {device}` (the usual mode; opening it grants "
                     "nothing by itself), or use the proxy network mode") from None
        if e.errno in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
            raise NetError(f"the nat network mode needs {device}, which this host does not have",
                           hint="load the tun module (`modprobe tun`) or use the proxy network mode") from None
        raise NetError(f"cannot open {device}: {e.strerror}") from None
    os.close(fd)


@dataclass
class UserNet:
    """A running pasta or slirp4netns attached to one network namespace
    (pid 0: one that starts on the namespace's first packet out)."""

    tool: Tool
    pid: int
    host_loopback: bool
    address: str = ADDRESS
    gateway: str = GATEWAY
    dns: str = DNS
    _id: int = 0
    _via: NetHelper | None = field(default=None, repr=False)

    async def program_pid(self) -> int | None:
        """The program's pid now: 0 while it stands by for the first packet
        out (start(tap=...)), None once it is stopped."""
        if not self._id or self._via is None:
            return None
        answer, _ = await self._via.request("query", id=self._id)
        return answer["pid"]

    @property
    def host_address(self) -> str | None:
        """The address of host.nsbox.internal inside, if the host is reachable."""
        return self.gateway if self.host_loopback else None

    async def stop(self, wait: bool = True) -> None:
        """Kills the program; `wait=False` returns once it is killed, before
        its exit completes (the helper reaps it)."""
        if self._id and self._via is not None:
            ident, self._id = self._id, 0
            try:
                await self._via.request("kill", id=ident, wait=wait)
            except NetError:
                pass  # the helper is gone, and what it started with it


def command(tool: Tool, path: str, *, host_loopback: bool, ifname: str = "tap0",
            with_user: bool = True, configure: bool = True) -> tuple[list[str], str]:
    """argv (with {fd0} = the network namespace, {fd1} = the user namespace,
    {ready_fd} = the readiness pipe) and how it signals readiness.
    configure=False: pasta attaches to a tap already made and configured
    (nsbox.net.ondemand)."""
    netns, userns = "/proc/self/fd/{fd0}", "/proc/self/fd/{fd1}"
    if tool == "pasta":
        argv = [path, "--foreground", "--quiet", "--stderr", *(["--config-net"] if configure else []),
                "--ns-ifname", ifname, "--mtu", str(MTU), "--address", ADDRESS, "--netmask", str(PREFIX),
                "--gateway", GATEWAY, "--dns-forward", DNS, "--ipv4-only",
                # No automatic port forwarding either way: the host's loopback
                # is reachable only through the gateway address.
                "-t", "none", "-u", "none", "-T", "none", "-U", "none",
                # Its pid, written once the tap is configured: the readiness signal.
                "--pid", "/proc/self/fd/{ready_fd}", "--netns", netns]
        if not host_loopback:
            argv.append("--no-map-gw")
        if with_user:
            argv += ["--userns", userns]
        if os.geteuid() == 0:
            argv += ["--runas", "0:0"]  # else it becomes nobody, who may not enter the namespace
        return argv, "line"
    # As pasta confines itself: slirp4netns parses what the sandbox sends,
    # so it runs under a seccomp filter. (--enable-sandbox, a mount
    # namespace of its own, needs privileges it lacks unless run as root.)
    argv = [path, "--configure", f"--mtu={MTU}", "--netns-type=path", "--ready-fd={ready_fd}",
            "--enable-seccomp"]
    if os.geteuid() == 0:
        argv.append("--enable-sandbox")
    if not host_loopback:
        argv.append("--disable-host-loopback")
    if with_user:
        argv.append(f"--userns-path={userns}")
    return argv + [netns, ifname], "byte"


def on_demand_tap(tool: Tool | None = None, ifname: str = "tap0") -> dict[str, object] | None:
    """How to make the tap for a pasta that starts at the namespace's first
    packet out (nsbox.net.ondemand.make_tap's arguments), or None where the
    program starts at once (slirp4netns: cheap to start, and it makes its
    own). Raises NetError, naming the fix, if the tun device is unusable."""
    check_tun()
    if find_tool(tool)[0] != "pasta":
        return None
    return {"ifname": ifname, "address": ADDRESS, "prefix": PREFIX, "gateway": GATEWAY, "dns": DNS, "mtu": MTU}


async def start(ns: Namespaces, *, host_loopback: bool = False, tool: Tool | None = None,
                watch_pidfd: int | None = None, tun_device: str = TUN_DEVICE, ifname: str = "tap0",
                tap: Sequence[int] | None = None, via: NetHelper | None = None) -> UserNet:
    """Attaches user-mode networking to the namespace (its loopback need not
    be up) and returns once the interface is configured.

    watch_pidfd: a pidfd of the sandbox's init; the program is stopped when
    that process exits, whoever holds the UserNet.
    tap: the tap made in the namespace as on_demand_tap() said, and the
    packet socket onto it (the caller's, still): pasta then starts only when
    the namespace first sends a frame out of it.
    """
    if tap is None:  # else the tun device has served already
        check_tun(tun_device)
    tool_name, path = find_tool(tool)
    if tap is not None and tool_name != "pasta":
        raise ValueError("only pasta starts on demand")
    argv, ready = command(tool_name, path, host_loopback=host_loopback, ifname=ifname,
                          with_user=ns.user is not None, configure=tap is None)
    fds = [ns.net, ns.user if ns.user is not None else ns.net]
    fields: dict[str, object] = {"argv": argv, "fds": [0, 1], "ready": ready}
    if watch_pidfd is not None:
        fds.append(watch_pidfd)
        fields["watch_fd"] = 2
    if tap is not None:
        fields.update(tap_fd=len(fds), sender_fd=len(fds) + 1)
        fds += list(tap)
    via = via or helper()
    try:
        answer, _ = await via.request("spawn" if tap is None else "standby", fds, **fields)
    except NetError as e:
        raise NetError(f"starting {tool_name} for the nat network failed: {e.message}",
                       hint=None if "tun" not in e.message else "check that /dev/net/tun is usable") from None
    return UserNet(tool_name, int(answer["pid"]), host_loopback, _id=int(answer["id"]), _via=via)
