"""Service networks, the public side: `nsbox.Network`, which sandboxes join
with `Sandbox(network=net)` (or `network="net:NAME"`).

    async with nsbox.Network("backend") as net:
        async with nsbox.Sandbox(network=net, hostname="db") as db, \
                   nsbox.Sandbox(network=net, hostname="web") as web:
            await web.exec(["ping", "-c1", "db"])

Each member has its own network namespace, with an address on the
network's private subnet (eth0) and its loopback; members reach each other
by hostname (and aliases), through /etc/hosts entries nsbox rewrites in
every member as members join and leave. Members of different networks
share nothing. A network that is not `internal` gives each member outbound
access as nat mode does (pasta or slirp4netns, `/dev/net/tun` needed), and
`host.nsbox.internal` where `host_access` allows it.

A network belongs to the process that made it, or, made with `named=True`
(`nsbox network create`), it outlives that process: any process of the
same user then joins sandboxes to it by name (`network="net:NAME"`,
`nsbox run --network net:NAME`) until `remove()` (`nsbox network rm`).

The plumbing is nsbox/net/bridge.py and its worker: a bridge in a network
namespace of its own, a veth pair per member. Unprivileged, the kernel lets
one process link two network namespaces only if it holds CAP_NET_ADMIN over
both owners: so the network's namespace belongs to a holder user namespace
(zygote.Holder, with the owner's maps) and members are created in it (their
user namespaces are its children), where the worker, having entered it,
holds that capability over all of them. A named network's members, made by
other processes, are created by a holder that enters its user namespace
(zygote.JoinedHolder). As real root no such owner is needed.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Iterator, Mapping, Sequence

import anyio

from .host import dirs, idmap, live
from .init import fdwait, files, protocol
from .init.client import InitClient
from .init.users import ROOT
from .create import zygote
from .net import bridge
from .net.client import Namespaces, NetError
from .spec import NET, NETWORK_NAME

_networks: dict[str, "Network"] = {}  # this process's networks and the named ones it reached
OTHERS_TIMEOUT = 5.0  # rewriting another process's member's /etc/hosts
_AS_ROOT = protocol.Creds(ROOT.uid, ROOT.gid, ROOT.groups)


@dataclass
class Member:
    """A member of this process: its sandbox, and how its /etc/hosts is
    rewritten as members come and go (`write_hosts(text)`, which skips a
    member that does not run yet, and says whether it wrote)."""

    sandbox_id: str
    write_hosts: Callable[[str], Awaitable[bool | None]]
    shown: str | None = None  # this network's /etc/hosts text known to be in it: the same is not rewritten


class Network:
    """A private network for sandboxes. Start it with `await net.start()`
    (or `async with`); close() removes it, or, for a named network, lets go
    of it (`remove()` ends it)."""

    def __init__(self, name: str, *, internal: bool = False, host_access: bool = False,
                 id_mapping: idmap.Requested = "auto", named: bool = False) -> None:
        check_network_name(name)
        self.name = name
        self.internal = internal
        self.host_access = host_access
        self.named = named
        self.mapping = idmap.detect(id_mapping)
        self.members: dict[str, Member] = {}  # this process's members, by hostname
        self._net = bridge.Network(name, internal=internal, host_access=host_access)
        self._owner: int | None = None  # a named network's user namespace (unprivileged)

    @property
    def spec_value(self) -> str:
        return NET + self.name

    async def start(self) -> "Network":
        if await _cached(self.name) is not None:
            raise NetError(f"a network called {self.name} exists already in this process")
        if not self.named:
            await self._start(None)
        else:
            with name_lock(self.name):  # one creator at a time: no worker may lose its socket to another
                if await _let_go(await _reachable(self.name)):
                    raise NetError(f"a network called {self.name} exists already",
                                   hint=f"`nsbox network rm {self.name}` removes it")
                clear_stale(self.name)
                self._net.subnet = await _subnet_for_named()
                await self._start(os.fspath(socket_path(self.name)))
        _networks[self.name] = self
        return self

    async def _start(self, path: str | None) -> None:
        owner = None
        if os.geteuid() != 0:
            holder = zygote.holder(self.mapping)
            if holder is None:
                raise NetError("service networks need nsbox's holder user namespace, which this host refused",
                               hint="check `nsbox doctor`; NSBOX_HOLDER=0 turns it off")
            owner = bridge.OwnerUserns(os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
        try:
            await self._net.start(owner, path=path, mapping=_mapping_key(self.mapping))
        finally:
            if owner is not None:
                owner.close()  # the worker lives in it, and keeps it

    @classmethod
    async def open(cls, name: str) -> "Network":
        """The named network `name` (made by this or any process of this user)."""
        check_network_name(name)
        net = await _cached(name)
        if net is not None:
            return net
        reached = await _reachable(name)
        if reached is None:
            raise NetError(f"network {name}: no such network",
                           hint=f"create it first: `nsbox network create {name}`")
        inner, owner = reached
        net = cls(name, internal=inner.internal, host_access=inner.host_access, named=True)
        net._net = inner
        if os.geteuid() != 0:
            net._owner = owner
        else:
            os.close(owner)
        _networks[name] = net
        return net

    async def __aenter__(self) -> "Network":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """A network of this process: removes it (its members lose their
        interface on it). A named network: lets go of it; it stays."""
        if _networks.get(self.name) is self:
            del _networks[self.name]
        with anyio.CancelScope(shield=True):
            await self._net.close()
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None

    async def remove(self) -> None:
        """Ends a named network; refused while sandboxes are on it."""
        await self._net.refresh()
        live = sorted(self._net.members)
        if live:
            raise NetError(f"network {self.name} has members: {', '.join(live)}",
                           hint="remove those sandboxes first (`nsbox rm`)")
        await self._net.stop()
        await self.close()

    def idle(self) -> bool:
        """Whether its worker runs and it has no member: a network its users
        emptied is as good as a new one."""
        return not self.members and not self._net.members and self._net.running()

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "internal": self.internal, "host_access": self.host_access,
                "subnet": str(self._net.subnet), "members": {n: m.ip for n, m in self._net.members.items()}}

    # ---- membership ------------------------------------------------------
    # A member (nsbox.Sandbox) calls, by its hostname: reserve() before its
    # clone, join() while its setup runs, settle() once it runs, leave() when
    # it closes or fails. The network never holds a Sandbox: a member of this
    # process rewrites its own /etc/hosts when asked (Member.write_hosts);
    # another process's is written through its init's socket.

    def owner_userns(self) -> int | None:
        """For a named network of an unprivileged user: its user namespace,
        which this process's sandboxes must be created in (a new descriptor,
        the caller's). None: this process's holder is the owner already."""
        return os.dup(self._owner) if self._owner is not None else None

    def check_mapping(self, mapping: idmap.IdMap) -> None:
        if self.named and self._net.mapping and self._net.mapping != _mapping_key(mapping):
            raise NetError(f"network {self.name} was created with another id mapping than this sandbox's",
                           hint="create its members with the id_mapping the network was created with")

    async def reserve(self, name: str, sandbox_id: str, write_hosts: Callable[[str], Awaitable[bool | None]], *,
                      aliases: Sequence[str] = (), extra_hosts: dict[str, str] | None = None) -> None:
        """Before its clone: the member's name and address (so its own
        /etc/hosts is written with its other files)."""
        if name in self.members:
            raise NetError(f"network {self.name} already has a member called {name}")
        self.members[name] = Member(sandbox_id, write_hosts)  # first: a reservation cut short is still forgotten on leave
        try:
            await self._net.reserve(name, aliases, sandbox=sandbox_id, extra=extra_hosts)
        except NetError:
            del self.members[name]  # refused: nothing of ours to forget
            raise

    async def join(self, name: str, pid: int, pidfd: int, *, ifname: str = "eth0", outbound: bool = True) -> None:
        """While the member's setup runs: its interface `ifname`, address
        and (`outbound`, not internal) outbound access (its init keeps its
        user and network namespace)."""
        ns = Namespaces.of_pid(pid)  # with its user namespace (unprivileged: for pasta to enter)
        try:
            if fdwait.readable_now(pidfd):  # its init exited
                raise NetError(f"{name} exited while joining network {self.name}")
            await self._net.connect(name, ns, watch_pidfd=pidfd, ifname=ifname, outbound=outbound)
        finally:
            ns.close()

    def hosts_for(self, hostname: str) -> str:
        """A member's /etc/hosts: its peers, its own extra hosts, the host.
        (Asked for the member's own files, or for a rewrite: that is what
        its file holds next, which later announcements compare with.)"""
        text = self._net.hosts_for(hostname)
        mine = self.members.get(hostname)
        if mine is not None:
            mine.shown = text
        return text

    async def settle(self, name: str) -> None:
        """Once the member runs: every member's /etc/hosts, its own too. (Its
        own was written with its files, but members reserved since, of this
        process or another's, are in it only now: a peer that settled while
        this member was still starting could not write to it. A file whose
        view did not change is not rewritten. Its resolver, on an outbound
        network, is nat mode's: nsbox/plan/netmodes.py.)"""
        await self._announce()

    async def _announce(self, but: str | None = None) -> None:
        """Rewrites /etc/hosts in every member (after a join or a leave),
        those of other processes too (a named network's)."""
        if self.named:
            await self._net.refresh()
        async with anyio.create_task_group() as tg:
            for name, member in list(self._net.members.items()):
                if name != but:
                    tg.start_soon(self._rewrite_hosts, name, member.sandbox)

    async def _rewrite_hosts(self, name: str, sandbox_id: str | None) -> None:
        mine = self.members.get(name)
        if mine is not None:
            text = self._net.hosts_for(name)
            if mine.shown == text:
                return  # its view did not change
            mine.shown = None  # unknown until written
            if await mine.write_hosts(text):
                mine.shown = text
            return
        if sandbox_id is None:
            return
        # Another process's member: through its init's socket, bounded (a
        # member that does not answer keeps its old file).
        with anyio.move_on_after(OTHERS_TIMEOUT):
            info = live.read(sandbox_id)
            if info is None or not info.init_alive:
                return  # gone: the worker forgets it when its init exits
            try:
                client = InitClient.connect(os.fspath(live.sandbox_dir(sandbox_id) / live.SOCKET), sandbox_id)
            except OSError:
                return
            try:
                await files.write_file(client, _AS_ROOT, "/etc/hosts", self.hosts_for(name))
            except Exception:
                pass
            finally:
                client.close()

    async def leave(self, name: str, sandbox_id: str) -> None:
        """Its leaving (or failed) member: the others forget it."""
        mine = self.members.get(name)
        if mine is None or mine.sandbox_id != sandbox_id:
            return  # never reserved (the name was another member's)
        del self.members[name]
        with anyio.CancelScope(shield=True):
            try:
                await self._net.forget(name, sandbox=sandbox_id)  # its veth pair goes with its namespace
                await self._announce()
            except Exception:
                pass  # a member closing at the same time: its next join rewrites all

    def release(self) -> list[tuple[str, str]]:
        """Forgets every member of this process here at once, announcing
        nothing (the caller is closing them all, together): their own
        leave() then finds nothing to do. Returns (name, sandbox id) of
        each, for forget()."""
        gone = [(name, member.sandbox_id) for name, member in self.members.items()]
        self.members.clear()
        return gone

    async def forget(self, gone: Sequence[tuple[str, str]]) -> None:
        """The worker forgets the members release() returned, in one request."""
        if gone:
            with anyio.CancelScope(shield=True):
                try:
                    await self._net.forget_many(gone)
                except NetError:
                    pass  # its worker is gone: so is the network

    def address_of(self, name: str) -> str:
        return self._net.members[name].ip


def more_networks(first: Network, more: Mapping[str, Sequence[str]]) -> list[tuple[Network, Sequence[str]]]:
    """The networks of a member's `more_networks` ("net:NAME" -> its aliases
    there), besides `first`: networks of this process, which share its
    holder user namespace, where the member is created and from which it
    can be linked into each (a named network has an owner of its own)."""
    nets = []
    for value, aliases in more.items():
        net = local(value)
        if net is None or net.named or first.named:
            raise NetError(f"network {value[len(NET):]}: a sandbox on several networks joins networks of "
                           "this process only, not named ones")
        nets.append((net, aliases))
    return nets


@dataclass
class Joined:
    """A member's several networks, as the network modes read one
    (netmodes.ServiceNetwork): the first, which carries its outbound
    traffic, decides `internal`, its own address and the host's entry;
    its /etc/hosts names its peers on each network by their names there."""

    nets: Sequence[Network]

    @property
    def internal(self) -> bool:
        return self.nets[0].internal

    def hosts_for(self, hostname: str) -> str:
        first, *more = self.nets
        peers = [(address, [n for n in names if n != hostname])
                 for net in more for address, names in net._net.peers(hostname)]
        return first.hosts_for(hostname) + "".join(f"{address}\t{' '.join(names)}\n"
                                                   for address, names in peers if names)


def check_network_name(name: str) -> None:
    if not NETWORK_NAME.fullmatch(name):
        raise ValueError(f"network name must be 1-64 letters, digits, '.', '_' or '-', not {name!r}")


def socket_path(name: str) -> Path:
    """Where a named network's worker listens."""
    return dirs.runtime_dir() / "networks" / f"{name}.sock"


def named_networks() -> list[str]:
    """The names of this user's named networks (some may have died)."""
    d = dirs.runtime_dir() / "networks"
    return sorted(p.name[:-len(".sock")] for p in d.glob("*.sock")) if d.is_dir() else []


async def _cached(name: str) -> Network | None:
    """This process's network `name`, or the named one it reached, if that
    one still runs (another process may have removed it since)."""
    net = _networks.get(name)
    if net is not None and net.named:
        try:
            await net._net.refresh()
        except NetError:
            await net.close()  # forgotten here too
            return None
    return net


async def _let_go(reached: "tuple[bridge.Network, int] | None") -> bool:
    """Closes what _reachable returned; whether there was anything."""
    if reached is None:
        return False
    await reached[0].close()
    os.close(reached[1])
    return True


async def _reachable(name: str) -> "tuple[bridge.Network, int] | None":
    """The named network's client and owner user namespace, if its worker
    runs; None if nothing listens there (never made, removed, or killed)."""
    path = socket_path(name)
    if not path.exists():
        return None
    try:
        return await bridge.Network.open(name, os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError):
        return None  # its worker was killed (a stale socket), or is stopping


async def _subnet_for_named() -> "ipaddress.IPv4Network":
    """A subnet no other named network of this user has, so that a member
    never shares an address with a member of another network."""
    used = set()
    for name in named_networks():
        try:
            reached = await _reachable(name)
        except NetError:
            continue  # not answering: its subnet is unknown
        if reached is not None:
            used.add(reached[0].subnet)
        await _let_go(reached)
    return bridge.allocate_subnet(avoid=used)


async def is_stale(name: str) -> bool:
    """Whether `name` has a socket but no worker behind it (killed)."""
    return socket_path(name).exists() and not await _let_go(await _reachable(name))


def clear_stale(name: str) -> None:
    """Removes the socket of a named network whose worker was killed (the
    caller holds name_lock and found nothing answering there)."""
    socket_path(name).unlink(missing_ok=True)


@contextlib.contextmanager
def name_lock(name: str) -> Iterator[None]:
    """Serializes creating and clearing the named network `name` among this
    user's processes."""
    d = socket_path(name).parent
    d.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(d / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NetError(f"network {name} is being created or removed by another process") from None
        yield
    finally:
        os.close(fd)


def _mapping_key(mapping: idmap.IdMap) -> str:
    maps = mapping.how_to_write()
    return f"{maps.uid_map}|{maps.gid_map}"


def local(value: str) -> Network | None:
    """The Network a "net:NAME" value names among those this process holds."""
    return _networks.get(value[len(NET):]) if value.startswith(NET) else None


async def lookup(value: str) -> Network:
    """The Network a "net:NAME" spec value names: this process's, or named
    (reached again if another process removed and made it anew)."""
    return await Network.open(value[len(NET):])
