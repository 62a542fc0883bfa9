"""The network contributor: what the nat and proxy modes and published ports
add to a sandbox's plan and to its lifetime (the building blocks are in
nsbox/net/).

- Plan: nat and proxy get a private network namespace with loopback up,
  exactly as "none" does (plan.contribute_network); nothing else happens
  between clone and go.
- Before the clone, `check()`: nat needs a usable /dev/net/tun and pasta
  or slirp4netns, and fails in one line naming the fix otherwise, before
  anything is created.
- After the init runs, `attach()`: nat starts pasta or slirp4netns on the
  sandbox's namespace (tied to the init's pidfd); proxy listens on the
  sandbox's 127.0.0.1:3128 and serves the allowlisting proxy; each
  published port listens on the host. The sandbox's /etc/hosts (nat:
  host.nsbox.internal, only where the host's loopback is asked for) and /etc/resolv.conf (nat: the DNS forwarder) are
  written by the caller through the init, for every kind of root.

Lifetime. The proxy and port listeners are served by this process, by a
single network thread (one per process, a daemon thread running its own
event loop and its own network helper process), whatever event loop or
task the caller uses: a Sandbox is started and closed by different tasks
(Inspect does so), which a task group could not straddle. Each sandbox's
serving runs in one task of that thread, under a cancel scope that
`Attached.stop()` cancels; the task then stops pasta/slirp4netns and closes
the namespace descriptors. When this process dies (even by SIGKILL), the
thread dies with it, the kernel closes the listeners, and the helper,
whose lifeline is its channel to this process, kills pasta/slirp4netns and
exits. pasta/slirp4netns also stop when the sandbox's init exits.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.from_thread import BlockingPortal

from ..net import hosts as hosts_mod
from ..net import usernet
from ..net.client import Namespaces, NetError, NetHelper, listen_in
from ..net.ports import PortSpec, PublishedPort
from ..net.proxy import DEFAULT_PORT, ProxyServer, proxy_env
from ..host import live
from ..host.idmap import IdMap
from ..host.layers import write_file
from ..spec import CONTAINER, HOST_GATEWAY, NET, SandboxSpec

PROXY_PORT = DEFAULT_PORT
# Names the proxy resolves itself, to addresses it trusts (even loopback):
# "name=address,name=address". For sites with internal services, and tests.
PROXY_HOSTS_ENV = "NSBOX_PROXY_HOSTS"


class ServiceNetwork(Protocol):
    """What this module reads of the nsbox.Network a "net:NAME" sandbox
    joins (the caller looked it up: nsbox/network.py is above the plan)."""

    internal: bool

    def hosts_for(self, hostname: str) -> str: ...


def mode(spec: SandboxSpec, net: ServiceNetwork | None = None) -> str:
    """The network mode in effect: a sandbox joining another's network
    (container:ID) has that sandbox's (its proxy, its nat and DNS forwarder).
    `net`: the service network a "net:NAME" spec joins."""
    if spec.network.startswith(NET):
        # A service network member: outbound (and its resolver) as in nat,
        # unless the network is internal.
        return "none" if net is None or net.internal else "nat"
    if not spec.network.startswith(CONTAINER):
        return spec.network
    return _joined_mode(spec.network[len(CONTAINER):])


_modes_of: dict[str, str] = {}  # sandbox id -> its network mode, which never changes


def _joined_mode(sandbox_id: str) -> str:
    """The network mode of the sandbox `container:ID` joins, read from its
    live entry once (a creation asks several times)."""
    if sandbox_id not in _modes_of:
        info = live.read(sandbox_id)
        if info is None:
            return "none"  # not (yet) there: not remembered
        _modes_of[sandbox_id] = info.network
    return _modes_of[sandbox_id]


def host_loopback(spec: SandboxSpec) -> bool:
    """Whether the sandbox asked for the host's loopback (host_loopback, or
    a `hosts` entry "host-gateway"). Only nat opens it, and only then:
    pasta and slirp4netns otherwise leave 10.0.2.2 unmapped."""
    return spec.host_loopback or HOST_GATEWAY in spec.hosts.values()


def extra_hosts(spec: SandboxSpec, gateway: str = usernet.GATEWAY) -> dict[str, str]:
    """spec.hosts with "host-gateway" replaced by where the host's loopback
    is (nat's gateway; 127.0.0.1 with the host's network)."""
    where = "127.0.0.1" if mode(spec) == "host" else gateway
    return {name: where if address == HOST_GATEWAY else address for name, address in spec.hosts.items()}


def needs_etc(spec: SandboxSpec) -> bool:
    return mode(spec) == "nat" or bool(spec.hosts) or spec.network.startswith(NET)


def private(spec: SandboxSpec) -> bool:
    """Whether the sandbox needs anything served by this process."""
    return spec.network in ("nat", "proxy") or bool(spec.ports)


def check(spec: SandboxSpec, net: ServiceNetwork | None = None) -> None:
    """Fails (NetError, one line naming the fix) before anything is created."""
    if mode(spec, net) == "nat":
        usernet.check_tun(usernet.TUN_DEVICE)
        usernet.find_tool()


def open_join(spec: SandboxSpec, mapping: IdMap) -> tuple[int, int] | None:
    """For network "container:ID": descriptors of sandbox ID's user and
    network namespaces (its init's), to create the new sandbox in; None
    for any other mode. Fails in one line if ID is not a running sandbox
    of this user with the same id mapping."""
    if not spec.network.startswith(CONTAINER):
        return None
    target = spec.network[len(CONTAINER):]
    info = live.read(target)
    if info is None or not info.init_alive:
        raise NetError(f"network {spec.network}: no running sandbox {target}")
    proc = f"/proc/{info.init_pid}"
    fds: list[int] = []
    try:
        for kind, ours in (("uid_map", mapping.uid_map), ("gid_map", mapping.gid_map)):
            with open(f"{proc}/{kind}") as f:
                theirs = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
            if theirs != [tuple(line) for line in ours]:
                raise NetError(f"network {spec.network}: sandbox {target} has another id mapping "
                               f"(create both with the same id_mapping)")
        for ns in ("user", "net"):
            fds.append(os.open(f"{proc}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
        if not live.process_alive(info.init_pid, info.init_start):
            raise NetError(f"network {spec.network}: sandbox {target} stopped")  # the pid was reused
        if not _sandbox_namespaces(fds[0], fds[1]):
            raise NetError(f"network {spec.network}: sandbox {target}'s init is not in namespaces nsbox made")
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise NetError(f"network {spec.network}: cannot open sandbox {target}'s namespaces: {e.strerror}") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], fds[1]


# ioctl(2) requests on namespace descriptors (linux/nsfs.h).
NS_GET_USERNS, NS_GET_PARENT, NS_GET_OWNER_UID = 0xB701, 0xB702, 0xB704


def _sandbox_namespaces(userns: int, netns: int) -> bool:
    """Whether `userns` is one a sandbox init lives in: created by our uid,
    owning `netns`, and a child of our own user namespace or of a holder's
    (a child of ours, also created by our uid; see native.Holder). A user
    namespace made by sandbox root (nested_userns) shows the same id maps
    from here, but lies deeper: joining it would put the new sandbox's init
    under another sandbox's root."""
    import array
    import fcntl

    ours = os.stat("/proc/self/ns/user").st_ino

    def owned(fd: int) -> bool:
        uid = array.array("I", [0])
        fcntl.ioctl(fd, NS_GET_OWNER_UID, uid, True)
        return uid[0] == os.geteuid()

    def parent(fd: int, request: int = NS_GET_PARENT) -> int:
        return fcntl.ioctl(fd, request)  # a new descriptor

    netns_owner = parent(netns, NS_GET_USERNS)
    up = parent(userns)
    try:
        if not owned(userns) or os.fstat(netns_owner).st_ino != os.fstat(userns).st_ino:
            return False
        if os.fstat(up).st_ino == ours:
            return True
        try:
            grand = parent(up)
        except PermissionError:
            return False  # beyond our own namespace
        try:
            return owned(up) and os.fstat(grand).st_ino == ours
        finally:
            os.close(grand)
    finally:
        os.close(up)
        os.close(netns_owner)


def environment(spec: SandboxSpec) -> dict[str, str]:
    """What the mode adds to every command's environment (under the sandbox's own env)."""
    return proxy_env(PROXY_PORT) if mode(spec) == "proxy" else {}


def etc_files(spec: SandboxSpec, hostname: str, net: ServiceNetwork | None = None) -> dict[str, str]:
    """The /etc files the mode (and extra hosts) need written into the
    sandbox once it runs. `net`: the service network it joins, if any."""
    peers = [(address, [name]) for name, address in extra_hosts(spec).items()]
    if net is not None:  # a member, reserved already
        hosts = net.hosts_for(hostname)
    elif mode(spec) == "nat":
        hosts = hosts_mod.render_hosts(hostname, peers,
                                       host_address=usernet.GATEWAY if host_loopback(spec) else None)
    else:
        return {"/etc/hosts": hosts_mod.render_hosts(hostname, peers)} if peers else {}
    if mode(spec, net) != "nat":
        return {"/etc/hosts": hosts}
    return {"/etc/hosts": hosts, "/etc/resolv.conf": hosts_mod.render_resolv_conf(usernet.DNS)}


def prepare_layer(spec: SandboxSpec, rootfs: object, layer: os.PathLike[str], hostname: str,
                  owner: tuple[int, int], net: ServiceNetwork | None = None) -> bool:
    """For the host-composed root, writes etc_files() with the sandbox's
    own /etc files (HostRootfs.etc_dir) before the clone, as its prepare()
    writes /etc/hosts (the host's own /etc/resolv.conf belongs to real
    root: sandbox root could not replace it). True if done; else the
    caller writes them through the init once it runs (a directory or
    image root, whose files are mapped)."""
    from .rootfs import HostRootfs

    if not isinstance(rootfs, HostRootfs):
        return False
    for path, text in etc_files(spec, hostname, net).items():
        write_file(HostRootfs.etc_dir(Path(layer)) / os.path.basename(path), text, owner)
    return True


def proxy_hosts() -> dict[str, str]:
    text = os.environ.get(PROXY_HOSTS_ENV, "")
    table = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, address = item.partition("=")
        if not sep or not name or not address:
            raise ValueError(f"{PROXY_HOSTS_ENV}: expected name=address, not {item!r}")
        table[name.strip()] = address.strip()
    return table


@dataclass
class Attached:
    """What serves one sandbox's network; `stop()` ends all of it."""

    tool: str | None = None         # "pasta" or "slirp4netns" (nat)
    usernet_pid: int | None = None
    host_ports: list[int] = field(default_factory=list)  # bound host port of each published port
    _scope: anyio.CancelScope | None = field(default=None, repr=False)
    _done: "Future[Any] | None" = field(default=None, repr=False)
    _runner: "Runner | None" = field(default=None, repr=False)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None or runner.portal is None or self._done is None:
            return
        scope, done = self._scope, self._done

        def cancel() -> None:
            if scope is not None:
                scope.cancel()

        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(runner.portal.call, cancel)
                await anyio.to_thread.run_sync(done.result)
            except Exception:
                pass  # the thread is gone: so is everything it served


class Runner:
    """The process's network thread: an event loop and a network helper of its own."""

    def __init__(self) -> None:
        self.portal: BlockingPortal | None = None
        self.helper = NetHelper()
        self.pid = os.getpid()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            async with BlockingPortal() as portal:
                self.portal = portal
                ready.set()
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(main)
            except BaseException as e:  # pragma: no cover - reported to the starter
                failure.append(e)
                ready.set()

        threading.Thread(target=run, name="nsbox-net", daemon=True).start()
        ready.wait()
        if failure:
            raise failure[0]

    async def serve(self, pid: int, pidfd: int, spec: SandboxSpec, *, task_status: Any) -> None:
        """Runs in the thread: sets up, reports an Attached, serves until cancelled, tears down."""
        ns = Namespaces.of_pid(pid)
        net: usernet.UserNet | None = None
        proxy_sock = None
        ports: list[PublishedPort] = []
        try:
            attached = Attached()
            if spec.network == "nat":
                net = await usernet.start(ns, host_loopback=host_loopback(spec), watch_pidfd=pidfd,
                                          via=self.helper)
                attached.tool, attached.usernet_pid = net.tool, net.pid
            if spec.network == "proxy":
                proxy_sock = await listen_in(ns, "127.0.0.1", PROXY_PORT, via=self.helper)
            for text in spec.ports:
                ports.append(await PublishedPort(PortSpec.parse(text), ns, via=self.helper).open())
            attached.host_ports = [p.host_port for p in ports]
            with anyio.CancelScope() as scope:
                attached._scope = scope
                task_status.started(attached)
                async with anyio.create_task_group() as tg:
                    if proxy_sock is not None:
                        sock, proxy_sock = proxy_sock, None
                        tg.start_soon(ProxyServer(spec.allow, hosts=proxy_hosts()).serve_socket, sock)
                    for port in ports:
                        tg.start_soon(port.serve)
                    await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                for port in ports:
                    try:
                        await port.aclose()
                    except Exception:
                        pass
                if proxy_sock is not None:
                    proxy_sock.close()
                if net is not None:
                    await net.stop(wait=False)  # killed now; its exit completes in the background
                ns.close()


_runner: Runner | None = None
_lock = threading.Lock()


def runner() -> Runner:
    global _runner
    with _lock:
        if _runner is None or _runner.pid != os.getpid():
            _runner = Runner()
        return _runner


async def attach(spec: SandboxSpec, pid: int, pidfd: int) -> Attached:
    """Starts what serves the sandbox's network (see the module's doc); its
    failures raise here, with nothing left running."""
    r = runner()
    assert r.portal is not None
    done, attached = await anyio.to_thread.run_sync(r.portal.start_task, r.serve, pid, pidfd, spec)
    attached._done, attached._runner = done, r
    return attached


_warned = False


def warn_detached(spec: SandboxSpec, own_networks: Sequence[str] = ()) -> None:
    """A detached sandbox keeps running; what this process serves does not:
    its nat or proxy, its published ports, and the service networks this
    process made (`own_networks`; a named network outlives it)."""
    global _warned
    if (private(spec) or own_networks) and not _warned:
        _warned = True
        what = {"nat": "nat networking", "proxy": "the proxy"}.get(spec.network)
        nets = f"network{'s' if len(own_networks) > 1 else ''} {', '.join(own_networks)}" if own_networks else None
        parts = [p for p in (what, "published ports" if spec.ports else None, nets) if p]
        print(f"nsbox: warning: the sandbox is detached, but its {' and '.join(parts)} "
              "end when this process exits", file=sys.stderr)
