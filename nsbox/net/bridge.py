"""Service networks: several sandboxes of one owner on a private subnet.

Layout of one network:

    network namespace of the network (its only process is the network's
    bridge worker, nsbox/net/helper.py, which makes the veth pairs)
      br0 ── veth0 ┐  ── veth1 ┐
                   │            │
    member A: eth0 10.89.N.2/24   member B: eth0 10.89.N.3/24

- The bridge has no address and nothing routes out of its namespace, so a
  member reaches the other members of its networks and nothing else: not
  members of other networks (another bridge, another namespace), not the
  host. Addresses are 10.89.N.0/24, private, used only inside namespaces
  nsbox creates.
- Names: `Network.hosts_for(name)` renders a member's /etc/hosts (its peers
  by name and alias); the caller writes it into every member whenever one
  joins or leaves.
- Outbound (a network that is not `internal`): each member gets its own
  pasta/slirp4netns, exactly as in nat mode (default route via its tap,
  the bridge subnet stays on eth0). The alternative, one pasta on the
  bridge namespace with NAT there, needs nf_tables masquerading inside the
  namespace (kernel modules and configuration that HPC kernels often lack,
  and a second routing hop); per-member user-mode networking needs nothing
  beyond what nat mode needs, and keeps each member's traffic separate.
  `host_access` decides whether host.nsbox.internal works.

Ownership rule (the kernel's, not ours): making a veth pair between two
network namespaces needs CAP_NET_ADMIN over both owning user namespaces,
from one process. Two sibling user namespaces of the same unprivileged user
cannot be linked (measured: EPERM). So, unless nsbox runs as real root,
members must be created *inside* the network's owner user namespace
(`OwnerUserns`): the sandbox's user namespace is then a child of it, and the
helper, having joined it, holds CAP_NET_ADMIN over the bridge's namespace
and every member's. As root no owner namespace is needed (pass None).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from typing import Sequence

from ..idmap import IdMap
from . import usernet
from .client import NetError, NetHelper, Namespaces, helper
from .hosts import check_name, render_hosts

BRIDGE = "br0"
_subnets_in_use: set[int] = set()


class OwnerUserns:
    """A user namespace of the owner, with the owner's id mapping, that the
    members of service networks live in (as children); held by a descriptor.

    Sandboxes created inside it map their ids onto it with
    `IdMap.nested_identity()` (ids 0..N onto the same ids), written by a
    process inside it, without newuidmap.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    async def create(cls, idmap: IdMap, *, via: NetHelper | None = None) -> "OwnerUserns":
        uid_map, gid_map, newuidmap, newgidmap, deny_setgroups = idmap.how_to_write()
        _, fds = await (via or helper()).request(
            "userns", uid_map=uid_map, gid_map=gid_map, newuidmap=newuidmap, newgidmap=newgidmap,
            deny_setgroups=deny_setgroups)
        return cls(fds[0])

    @property
    def path(self) -> str:
        """A path naming it, valid in this process (e.g. for nsenter --user=)."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Member:
    name: str
    aliases: tuple[str, ...]
    address: str            # with prefix, e.g. 10.89.3.2/24
    ifname: str             # inside the member
    host_ifname: str        # in the network's namespace
    usernet: usernet.UserNet | None = None

    @property
    def ip(self) -> str:
        return self.address.split("/")[0]


@dataclass
class Network:
    """A service network. `await start()`, then `connect()` members."""

    name: str
    internal: bool = False
    host_access: bool = False
    subnet: ipaddress.IPv4Network | None = None
    members: dict[str, Member] = field(default_factory=dict)
    _netns: int = -1
    _via: NetHelper | None = None
    _worker: NetHelper | None = None
    _last_address: int = -1  # index in the subnet's host addresses

    async def start(self, owner: OwnerUserns | None, *, via: NetHelper | None = None) -> "Network":
        """Creates the network's namespace and bridge. owner: where members
        live (None only as real root)."""
        if owner is None and os.geteuid() != 0:
            raise NetError("a service network needs an owner user namespace unless nsbox runs as root")
        self._via = via or helper()
        if self.subnet is None:
            self.subnet = _allocate_subnet()
        fds = [owner.fd] if owner is not None else []
        _, got = await self._via.request("network", fds, user_fd=0 if fds else None, bridge=BRIDGE)
        self._netns = got[0]
        self._worker = NetHelper(socket.socket(fileno=got[1]))
        return self

    async def connect(self, name: str, ns: Namespaces, *, aliases: Sequence[str] = (), ifname: str = "eth0",
                      watch_pidfd: int | None = None, tool: usernet.Tool | None = None) -> Member:
        """Adds a member: a veth pair from the bridge into `ns`, an address, and
        (not internal) user-mode networking for its outbound traffic. `ns.net`
        must belong to a user namespace inside the owner's one (or, as root,
        anywhere)."""
        if self._worker is None or self._via is None or self.subnet is None:
            raise NetError(f"network {self.name} is not started")
        check_name(name)
        for alias in aliases:
            check_name(alias)
        taken = {n for m in self.members.values() for n in (m.name, *m.aliases)}
        if name in taken or taken.intersection(aliases):
            raise NetError(f"network {self.name} already has a member called {name} (or one of {list(aliases)})")
        address = self._free_address()
        try:
            got, _ = await self._worker.request("take", [ns.net], member_fd=0, ifname=ifname, address=address)
        except NetError as e:
            raise NetError(f"joining {name} to network {self.name} failed: {e.message}",
                           hint=None if "not permitted" not in e.message else
                           "the sandbox must be created inside the network owner's user namespace") from None
        member = Member(name, tuple(aliases), address, ifname, got["host_ifname"])
        self.members[name] = member
        if not self.internal:
            try:
                member.usernet = await usernet.start(ns, host_loopback=self.host_access, tool=tool,
                                                     watch_pidfd=watch_pidfd, via=self._via)
            except BaseException:
                await self.disconnect(name)
                raise
        return member

    def forget(self, name: str) -> None:
        """Drops a member whose namespace is going away with its sandbox: the
        kernel removes its veth pair with the namespace, and its user-mode
        networking stops when the sandbox's init exits (watch_pidfd)."""
        self.members.pop(name, None)

    async def disconnect(self, name: str) -> None:
        member = self.members.pop(name, None)
        if member is None or self._worker is None:
            return
        if member.usernet is not None:
            await member.usernet.stop()
        try:
            await self._worker.request("detach", host_ifname=member.host_ifname)
        except NetError:
            pass  # the member's namespace is gone already: so is the pair

    def _free_address(self) -> str:
        """The next free address after the last one given: an address is not
        reused while the subnet has others (members may still hold the
        previous owner's in their neighbour tables)."""
        assert self.subnet is not None
        used = {m.ip for m in self.members.values()}
        hosts = list(self.subnet.hosts())[1:]  # .1 stays free (no gateway on a service network)
        for i in range(len(hosts)):
            ip = str(hosts[(self._last_address + 1 + i) % len(hosts)])
            if ip not in used:
                self._last_address = hosts.index(ipaddress.ip_address(ip))
                return f"{ip}/{self.subnet.prefixlen}"
        raise NetError(f"network {self.name} is full ({len(hosts)} members)")

    def peers(self, of: str | None = None) -> list[tuple[str, list[str]]]:
        """(address, [name, aliases...]) of every member but `of`."""
        return [(m.ip, [m.name, *m.aliases]) for m in self.members.values() if m.name != of]

    def hosts_for(self, name: str, hostname: str | None = None) -> str:
        """The /etc/hosts text of member `name` (its hostname defaults to its name)."""
        member = self.members[name]
        host = member.usernet.host_address if member.usernet else None
        return render_hosts(hostname or name, self.peers(name), host_address=host, own_address=member.ip)

    async def close(self) -> None:
        """Removes every member's interface and user-mode networking, and the
        network's namespace (with its bridge and the veth pairs)."""
        for name in list(self.members):
            member = self.members.pop(name)
            if member.usernet is not None:
                await member.usernet.stop()
        if self._worker is not None:
            await self._worker.aclose()  # the worker exits, and leaves the namespace
            self._worker = None
        if self._netns >= 0:
            os.close(self._netns)  # the last reference: the kernel removes the namespace
            self._netns = -1
        if self.subnet is not None:
            _subnets_in_use.discard(int(self.subnet.network_address.packed[2]))


def _allocate_subnet() -> ipaddress.IPv4Network:
    for n in range(1, 255):
        if n not in _subnets_in_use:
            _subnets_in_use.add(n)
            return ipaddress.IPv4Network(f"10.89.{n}.0/24")
    raise NetError("no free subnet left for another network (254 in use)")
