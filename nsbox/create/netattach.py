"""A sandbox's network attachment: what its network mode and its service
network give it, from before its clone to its close.

- Before the clone: the mode's checks and environment (nsbox/plan/netmodes.py),
  the sandbox's name and address on its service network (`reserve`), the
  /etc files written into its layer where the root allows, and what the
  plan joins (another sandbox's namespaces, a named network's user
  namespace) with its interface on the service network made while its
  setup runs (`contribute`).
- Once its init runs (`start`): nat, proxy and published ports served by
  this process (netmodes.Attached), the /etc files written through the
  init where the layer could not take them, the other members told.
- At close: `leave` the service network, `stop` what this process serves.

The service networks are the nsbox.Networks the caller looked up (they
are above create/), each with the sandbox's aliases there: interface eth0
on the first (the one outbound traffic takes), eth1... on the others. The
network modes read one view of them all (netmodes.ServiceNetwork: the
first network, or a view joining them for /etc/hosts).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Awaitable, Callable, Protocol, Sequence

from ..errors import SandboxUnavailable
from ..host.idmap import IdMap
from ..init import files, users
from ..init.client import InitClient
from ..plan import netmodes
from ..plan.plan import Plan
from ..spec import SandboxSpec
from .launch import Launched


class ServiceNetwork(netmodes.ServiceNetwork, Protocol):
    """What a member uses of the nsbox.Network it joins (nsbox/network.py)."""

    name: str
    named: bool  # it outlives the process that made it

    def owner_userns(self) -> int | None: ...

    async def reserve(self, name: str, sandbox_id: str, write_hosts: Callable[[str], Awaitable[bool]], *,
                      aliases: Sequence[str] = (), extra_hosts: dict[str, str] | None = None) -> None: ...

    async def join(self, name: str, pid: int, pidfd: int, *, ifname: str = "eth0", outbound: bool = True) -> None: ...

    async def settle(self, name: str) -> None: ...

    async def leave(self, name: str, sandbox_id: str) -> None: ...


class NetAttachment:
    """One sandbox's network, made and ended with it (see the module's doc).
    `client()`: the sandbox's init client, None until it runs and after."""

    def __init__(self, spec: SandboxSpec, service_view: netmodes.ServiceNetwork | None,
                 networks: Sequence[tuple[ServiceNetwork, Sequence[str]]], hostname: str, sandbox_id: str,
                 client: Callable[[], InitClient | None]) -> None:
        self.spec = spec
        self.service_net = service_view
        self.networks = list(networks)
        self.closing = False  # set at close: peers leaving no longer rewrite its /etc/hosts
        self.hostname = hostname
        self.sandbox_id = sandbox_id
        self._client = client
        self.attached: netmodes.Attached | None = None  # what this process serves for nat, proxy and ports
        self._etc_written = False

    def own_networks(self) -> list[str]:
        """The networks it is on that end with this process."""
        return [net.name for net, _ in self.networks if not net.named]

    def check(self) -> SandboxSpec:
        """Fails in one line before anything exists (nat without a usable
        tun device); returns the spec with the mode's environment."""
        netmodes.check(self.spec, self.service_net)
        if extra_env := netmodes.environment(self.spec):
            self.spec = self.spec.replace(env={**extra_env, **self.spec.env})
        return self.spec

    async def reserve(self) -> None:
        for net, aliases in self.networks:
            await net.reserve(self.hostname, self.sandbox_id, self._write_hosts, aliases=aliases,
                              extra_hosts=netmodes.extra_hosts(self.spec))

    def prepare_layer(self, rootfs: object, layer: Path, owner: tuple[int, int]) -> None:
        """The /etc files, written into the layer where the root allows."""
        self._etc_written = netmodes.prepare_layer(self.spec, rootfs, layer, self.hostname, owner, self.service_net)

    def contribute(self, plan: Plan, mapping: IdMap, launched: Launched) -> None:
        """The namespaces the plan joins and the interface made while its
        setup runs; close_plan() closes the descriptors after the launch."""
        plan.join = netmodes.open_join(self.spec, mapping)
        if self.networks:  # they share one holder user namespace (nsbox/network.py)
            plan.userns = self.networks[0][0].owner_userns()
        for index, (net, _) in enumerate(self.networks):
            plan.alongside.append(functools.partial(self._join, net, index, launched))

    async def _join(self, net: ServiceNetwork, index: int, launched: Launched, pid: int) -> None:
        await net.join(self.hostname, pid, launched.pidfd, ifname=f"eth{index}", outbound=index == 0)

    @staticmethod
    def close_plan(plan: Plan) -> None:
        for fd in [*(plan.join or ()), *([plan.userns] if plan.userns is not None else [])]:
            os.close(fd)

    async def start(self, pid: int, pidfd: int) -> None:
        """Once the init runs: what this process serves, the /etc files, the
        other members."""
        if netmodes.private(self.spec):
            self.attached = await netmodes.attach(self.spec, pid, pidfd)
        if netmodes.needs_etc(self.spec) and not self._etc_written:
            for path, text in netmodes.etc_files(self.spec, self.hostname, self.service_net).items():
                await self._write_as_root(path, text)
        for net, _ in self.networks:
            await net.settle(self.hostname)

    @property
    def host_ports(self) -> list[int]:
        return list(self.attached.host_ports) if self.attached is not None else []

    async def leave(self) -> None:
        for net, _ in self.networks:
            await net.leave(self.hostname, self.sandbox_id)

    async def stop(self) -> None:
        """Ends what this process serves (a detached sandbox's ends with this process)."""
        if self.attached is not None:
            attached, self.attached = self.attached, None
            await attached.stop()

    async def _write_as_root(self, path: str, text: str) -> None:
        """A file nsbox keeps in the sandbox (/etc/hosts, resolv.conf)."""
        client = self._client()
        if client is None:
            raise SandboxUnavailable(f"sandbox {self.sandbox_id} is not running")
        await files.write_file(client, users.creds(users.ROOT), path, text)

    async def _write_hosts(self, text: str) -> bool:
        """Its service network's call as members come and go (Network.reserve); whether it wrote."""
        if self._client() is None or self.closing:  # not running (or starting) yet, or going
            return False
        if len(self.networks) > 1 and self.service_net is not None:  # its peers on all of them
            text = self.service_net.hosts_for(self.hostname)
        await self._write_as_root("/etc/hosts", text)
        return True
