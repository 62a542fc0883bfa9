"""Service networks: several sandboxes of one owner on a private subnet.

Layout of one network:

    network namespace of the network (its only process is the network's
    bridge worker, nsbox/net/helper.py, which makes the veth pairs)
      br0 ── veth0 ┐  ── veth1 ┐
                   │            │
    member A: eth0 10.89.N.2/24   member B: eth0 10.89.N.3/24

  (a member of several networks has one interface on each: eth0, eth1...)

- The bridge has no address and nothing routes out of its namespace, so a
  member reaches the other members of its networks and nothing else: not
  members of other networks (another bridge, another namespace), not the
  host. Addresses are 10.89.N.0/24, private, used only inside namespaces
  nsbox creates.
- Names: `Network.hosts_for(name)` renders a member's /etc/hosts (its peers
  by name and alias); the caller writes it into every member whenever one
  joins or leaves.
- Outbound (a network that is not `internal`): each member gets its own
  pasta/slirp4netns, as in nat mode (default route via its tap, the
  bridge subnet stays on eth0); pasta starts only at the member's first
  packet out (ondemand.py), on a tap the worker makes at the join. The
  alternative, one pasta on the bridge namespace with NAT there, needs
  nf_tables masquerading inside the namespace (kernel modules and
  configuration that HPC kernels often lack, and a second routing hop);
  per-member user-mode networking needs nothing beyond what nat mode
  needs, and keeps each member's traffic separate.
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
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

import anyio

from ..host.idmap import IdMap
from . import usernet
from .client import NetError, NetHelper, Namespaces, helper, receive
from .hosts import check_name, render_hosts

BRIDGE = "br0"
REQUEST_TIMEOUT = 10.0  # a worker answers in milliseconds; one that does not is wedged
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
        maps = idmap.how_to_write()
        _, fds = await (via or helper()).request(
            "userns", uid_map=maps.uid_map, gid_map=maps.gid_map, newuidmap=maps.newuidmap,
            newgidmap=maps.newgidmap, deny_setgroups=maps.deny_setgroups)
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
    ip: str
    host_ifname: str = ""   # in the network's namespace, once joined
    sandbox: str | None = None  # its sandbox's id
    usernet: "usernet.UserNet | None" = None  # this process's, for its outbound traffic
    extra: dict[str, str] = field(default_factory=dict)  # its own extra /etc/hosts entries, name -> address


async def _worker_ready(chan: socket.socket) -> int:
    """Waits for a new bridge worker's ready message (the helper answered
    once it forked it): the network's namespace (a descriptor), or raises
    the worker's error."""
    chan.setblocking(False)
    data, fds = b"", []
    with anyio.move_on_after(REQUEST_TIMEOUT) as waited:
        data, fds = await receive(chan, 1)
    if waited.cancelled_caught:
        raise NetError(f"the network's bridge worker was not ready within {REQUEST_TIMEOUT:g}s")
    answer = json.loads(data) if data else {"error": "the bridge worker exited while starting"}
    if "error" not in answer and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise NetError(answer.get("error", "the bridge worker's ready message had no namespace"))


@dataclass
class Network:
    """A service network: a client of its bridge worker (bridge_worker.py),
    which keeps the member table. `await start()` makes one (of this
    process, or named: `path`), `await Network.open(path)` reaches a named
    one; then `reserve()` and `connect()` members."""

    name: str
    internal: bool = False
    host_access: bool = False
    subnet: ipaddress.IPv4Network | None = None
    mapping: str = ""  # the owner's id maps: members must have the same
    members: dict[str, Member] = field(default_factory=dict)  # the worker's table, as last seen
    _netns: int = -1
    _via: NetHelper | None = None
    _worker: NetHelper | None = None
    _own_subnet: bool = False

    async def start(self, owner: OwnerUserns | None, *, via: NetHelper | None = None,
                    path: str | None = None, mapping: str = "") -> "Network":
        """Creates the network's namespace, bridge and worker. owner: where
        members live (None only as real root). path: a named network's
        socket, which outlives this process."""
        if owner is None and os.geteuid() != 0:
            raise NetError("a service network needs an owner user namespace unless nsbox runs as root")
        self._via = via or helper()
        self.mapping = mapping
        allocated = self.subnet is None
        if allocated:
            self.subnet, self._own_subnet = _allocate_subnet(), True
        fds = [owner.fd] if owner is not None else []
        try:
            _, got = await self._via.request("network", fds, user_fd=0 if fds else None, bridge=BRIDGE,
                                             subnet=str(self.subnet), internal=self.internal,
                                             host_access=self.host_access, mapping=mapping, path=path)
            chan = socket.socket(fileno=got[0])
            try:
                self._netns = await _worker_ready(chan)
            except BaseException:
                chan.close()  # a worker of this process ends with it
                raise
        except BaseException:  # failed or cancelled: the subnet is free again
            if allocated:
                self._release_subnet()
                self.subnet = None
            raise
        self._worker = NetHelper(chan)
        return self

    @classmethod
    async def open(cls, name: str, path: str, *, via: NetHelper | None = None) -> tuple["Network", int]:
        """Reaches the named network listening at `path`. Also returns its
        owner's user namespace (a descriptor, the caller's)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)  # a worker whose backlog is full: EAGAIN, not a hang
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            raise NetError(f"network {name} is not answering") from None
        except OSError:
            sock.close()
            raise
        net = cls(name, _via=via or helper(), _worker=NetHelper(sock))
        try:
            info, fds = await net._request("info")
        except BaseException:
            await net.close()
            raise
        net.internal, net.host_access = info["internal"], info["host_access"]
        net.subnet, net.mapping = ipaddress.IPv4Network(info["subnet"]), info["mapping"]
        return net, fds[0]

    def _mirror(self, table: list[dict[str, Any]]) -> None:
        mine = {name: m.usernet for name, m in self.members.items()}
        self.members = {m["name"]: Member(m["name"], tuple(m["aliases"]), m["address"], m["host_ifname"],
                                          m.get("sandbox"), mine.get(m["name"]), m.get("extra", {}))
                        for m in table}

    async def _request(self, op: str, fds: Sequence[int] = (), **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """One request to the worker: its answer (the member table in it is
        mirrored) and the descriptors it carries (the caller's)."""
        if self._worker is None:
            raise NetError(f"network {self.name} is closed")
        try:
            with anyio.fail_after(REQUEST_TIMEOUT):
                answer, got = await self._worker.request(op, fds, **fields)
        except NetError as e:
            raise NetError(f"network {self.name}: {e.message}") from None
        except TimeoutError:
            raise NetError(f"network {self.name}: its worker did not answer within {REQUEST_TIMEOUT:g}s") from None
        if "members" in answer:
            self._mirror(answer["members"])
        return answer, got

    async def _ask(self, op: str, fds: Sequence[int] = (), **fields: Any) -> dict[str, Any]:
        """One request to the worker, descriptors in its reply closed."""
        answer, got = await self._request(op, fds, **fields)
        for fd in got:
            os.close(fd)
        return answer

    def running(self) -> bool:
        """Whether its worker still runs, as far as this process can tell
        without a request."""
        return self._worker is not None and not self._worker.ended()

    async def refresh(self) -> None:
        """The member table as it is now (members of other processes too)."""
        await self._ask("info")

    async def reserve(self, name: str, aliases: Sequence[str] = (), *, sandbox: str | None = None,
                      extra: dict[str, str] | None = None) -> Member:
        """Gives `name` its address before its sandbox exists (its /etc/hosts
        can then be written with the rest of its files); connect() joins it.
        extra: the member's own extra /etc/hosts entries (name -> address),
        kept with it for whichever process rewrites its /etc/hosts."""
        check_name(name)
        for alias in aliases:
            check_name(alias)
        await self._ask("reserve", name=name, aliases=list(aliases), sandbox=sandbox, extra=extra or {})
        return self.members[name]

    async def connect(self, name: str, ns: Namespaces, *, aliases: Sequence[str] = (),
                      watch_pidfd: int | None = None, tool: usernet.Tool | None = None,
                      ifname: str = "eth0", outbound: bool = True) -> Member:
        """Joins a member (reserved before, or now): a veth pair from the
        bridge into `ns` (its `ifname`, with its address), and (not
        internal, and `outbound`: a member of several networks has one
        way out) user-mode networking for its outbound traffic. `ns.net` must belong
        to a user namespace inside the owner's one (or, as root, anywhere).
        The worker forgets the member when `watch_pidfd` (its init) exits."""
        member = self.members.get(name)
        if member is None or member.host_ifname:
            member = await self.reserve(name, aliases)
        fds = [ns.net, *([watch_pidfd] if watch_pidfd is not None else [])]
        outbound = outbound and not self.internal
        # pasta starts at the member's first packet out, on a tap the worker
        # makes with the member's interface (nsbox/net/ondemand.py).
        tap = usernet.on_demand_tap(tool) if outbound else None
        try:
            got, tap_fds = await self._request("take", fds, name=name, member_fd=0, ifname=ifname,
                                               pidfd_fd=1 if watch_pidfd is not None else None, tap=tap)
        except NetError as e:
            await self.forget(name)
            raise NetError(f"joining {name}: {e.message}",
                           hint=None if "not permitted" not in e.message else
                           "the sandbox must be created inside the network owner's user namespace") from None
        member.host_ifname = got["host_ifname"]
        try:
            if outbound:
                member.usernet = await usernet.start(ns, host_loopback=self.host_access, tool=tool,
                                                     watch_pidfd=watch_pidfd, tap=tap_fds or None, via=self._via)
        except BaseException:
            await self.disconnect(name)
            raise
        finally:
            for fd in tap_fds:
                os.close(fd)
        return member

    async def forget(self, name: str, *, sandbox: str | None = None) -> None:
        """Drops a member whose namespace is going away with its sandbox: the
        kernel removes its veth pair with the namespace, and its user-mode
        networking stops when the sandbox's init exits (watch_pidfd).
        sandbox: only if the name is still that sandbox's."""
        if self._worker is not None:
            await self._ask("leave", name=name, sandbox=sandbox, unlink=False)

    async def forget_many(self, members: Sequence[tuple[str, str | None]]) -> None:
        """forget() of several members (name, sandbox), in one request."""
        if self._worker is not None:
            await self._ask("leave", members=[list(m) for m in members], unlink=False)

    async def disconnect(self, name: str) -> None:
        """Removes a member whose sandbox stays: its pair and outbound go."""
        member = self.members.get(name)
        if member is not None and member.usernet is not None:
            await member.usernet.stop()
        await self._ask("leave", name=name, unlink=True)

    def peers(self, of: str | None = None) -> list[tuple[str, list[str]]]:
        """(address, [name, aliases...]) of every member but `of`."""
        return [(m.ip, [m.name, *m.aliases]) for m in self.members.values() if m.name != of]

    def hosts_for(self, name: str) -> str:
        """The /etc/hosts text of member `name`: its peers, its own extra
        entries, and host.nsbox.internal where the network allows."""
        member = self.members[name]
        host = usernet.GATEWAY if self.host_access and not self.internal else None
        own = [(address, [n]) for n, address in member.extra.items()]
        return render_hosts(name, [*self.peers(name), *own], host_address=host, own_address=member.ip,
                            aliases=member.aliases)

    async def stop(self) -> None:
        """Ends a named network (refused while it has members)."""
        await self._ask("stop")
        await self.close()

    async def close(self) -> None:
        """Stops this process's members' user-mode networking and lets go of
        the worker: a network of this process ends with it (its namespace,
        bridge and veth pairs), a named one stays."""
        for member in self.members.values():
            if member.usernet is not None:
                await member.usernet.stop()
        if self._worker is not None:
            await self._worker.aclose()
            self._worker = None
        if self._netns >= 0:
            os.close(self._netns)
            self._netns = -1
        self._release_subnet()

    def _release_subnet(self) -> None:
        """Once: a second close must not free a number another network took since."""
        if self._own_subnet and self.subnet is not None:
            _subnets_in_use.discard(int(self.subnet.network_address.packed[2]))
            self._own_subnet = False


def _allocate_subnet() -> ipaddress.IPv4Network:
    """A subnet for a network of this process."""
    subnet = allocate_subnet()
    _subnets_in_use.add(int(subnet.network_address.packed[2]))
    return subnet


def allocate_subnet(avoid: set[ipaddress.IPv4Network] = set()) -> ipaddress.IPv4Network:
    """The first 10.89.N.0/24 that neither this process's networks nor `avoid` use."""
    for n in range(1, 255):
        subnet = ipaddress.IPv4Network(f"10.89.{n}.0/24")
        if n not in _subnets_in_use and subnet not in avoid:
            return subnet
    raise NetError("no free subnet left for another network (254 in use)")
