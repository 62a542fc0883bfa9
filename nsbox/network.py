"""Service networks, the public side: `nsbox.Network`, which sandboxes of
this process join with `Sandbox(network=net)`.

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

The plumbing is nsbox/net/bridge.py: a bridge in a network namespace of
its own, a veth pair per member. Unprivileged, the kernel lets one process
link two network namespaces only if it holds CAP_NET_ADMIN over both
owners: so the network's namespace belongs to this process's holder user
namespace (native.Holder) and members are created in it (their user
namespaces are its children), where the network helper, entering the
holder's namespace, holds that capability over all of them. As real root
no such owner is needed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

import anyio

from . import idmap, native
from .net import bridge
from .net.client import Namespaces, NetError
from .spec import NET, NETWORK_NAME

if TYPE_CHECKING:
    from .sandbox import Sandbox

_networks: dict[str, "Network"] = {}


class Network:
    """A private network that sandboxes of this process join. Start it with
    `await net.start()` (or `async with`); close() removes it."""

    def __init__(self, name: str, *, internal: bool = False, host_access: bool = False,
                 id_mapping: idmap.Requested = "auto") -> None:
        if not NETWORK_NAME.fullmatch(name):
            raise ValueError(f"network name must be 1-64 letters, digits, '.', '_' or '-', not {name!r}")
        self.name = name
        self.internal = internal
        self.host_access = host_access
        self.mapping = idmap.detect(id_mapping)
        self.members: dict[str, "Sandbox"] = {}
        self._net = bridge.Network(name, internal=internal, host_access=host_access)
        self._owner: bridge.OwnerUserns | None = None

    @property
    def spec_value(self) -> str:
        return NET + self.name

    async def start(self) -> "Network":
        if self.name in _networks:
            raise NetError(f"a network called {self.name} exists already in this process")
        owner = None
        if os.geteuid() != 0:
            holder = native.holder(self.mapping)
            if holder is None:
                raise NetError("service networks need nsbox's holder user namespace, which this host refused",
                               hint="check `nsbox doctor`; NSBOX_HOLDER=0 turns it off")
            owner = bridge.OwnerUserns(os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
        try:
            await self._net.start(owner)
        except BaseException:
            if owner is not None:
                owner.close()
            raise
        self._owner = owner
        _networks[self.name] = self
        return self

    async def __aenter__(self) -> "Network":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Removes the network; its members lose their interface on it."""
        if _networks.get(self.name) is self:
            del _networks[self.name]
        with anyio.CancelScope(shield=True):
            await self._net.close()
        if self._owner is not None:
            self._owner.close()
            self._owner = None

    # ---- membership (Sandbox calls these) ---------------------------------

    async def _join(self, sandbox: "Sandbox", pid: int, pidfd: int, aliases: Sequence[str] = ()) -> None:
        """Between clone and go: the member's interface, address and outbound."""
        ns = Namespaces.of_pid(pid)  # with its user namespace (unprivileged: for pasta to enter)
        try:
            await self._net.connect(sandbox.hostname, ns, aliases=aliases, watch_pidfd=pidfd)
        finally:
            ns.close()
        self.members[sandbox.hostname] = sandbox

    async def _settle(self, sandbox: "Sandbox") -> None:
        """Once the member runs: every member's /etc/hosts. (Its resolver,
        on an outbound network, is nat mode's: nsbox/netplan.py.)"""
        await self._announce()

    async def _announce(self) -> None:
        """Rewrites /etc/hosts in every member (after a join or a leave)."""
        async with anyio.create_task_group() as tg:
            for name, sb in list(self.members.items()):
                if sb._client is not None:  # running, or starting (a member that just joined)
                    tg.start_soon(sb._write_as_root, "/etc/hosts", self._net.hosts_for(name))

    async def _leave(self, sandbox: "Sandbox") -> None:
        if self.members.get(sandbox.hostname) is not sandbox:
            return
        del self.members[sandbox.hostname]
        self._net.forget(sandbox.hostname)  # its veth pair goes with its namespace
        with anyio.CancelScope(shield=True):
            try:
                await self._announce()
            except Exception:
                pass  # a member closing at the same time: its next join rewrites all

    def address_of(self, name: str) -> str:
        return self._net.members[name].ip


def find(value: str) -> Network | None:
    """The running Network a "net:NAME" spec value names, if any (None for
    any other network mode)."""
    return _networks.get(value[len(NET):]) if value.startswith(NET) else None


def lookup(value: str) -> Network:
    """The running Network a "net:NAME" spec value names."""
    name = value[len(NET):]
    net = _networks.get(name)
    if net is None:
        raise NetError(f"network {name}: no such network in this process",
                       hint="create it first: `async with nsbox.Network(name) as net`")
    return net
