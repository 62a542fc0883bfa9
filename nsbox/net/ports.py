"""Published ports: `-p [ADDRESS:]HOSTPORT:PORT` makes a TCP port of the
sandbox reachable on the host, on 127.0.0.1 unless another address is named.

The listener is an ordinary socket of this process on the host. Each
connection it accepts is paired with a connection to 127.0.0.1:PORT made
from inside the sandbox's network namespace (by the network helper, which
hands the connected socket back), and bytes are copied between the two.
So it works the same in every network mode that has its own namespace
(none, proxy, nat, service networks), needs no tun device and starts no
process in the sandbox. A service inside listening on 0.0.0.0 or on
127.0.0.1 is reached either way.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import weakref
from dataclasses import dataclass

import anyio
from anyio.abc import SocketListener, SocketStream

from .client import NetError, NetHelper, Namespaces, connect_in
from .proxy import MAX_CONNECTIONS, relay, serve_bounded

_SPEC = re.compile(r"^(?:(?P<addr>\[[0-9a-fA-F:.]+\]|[0-9.]+):)?(?P<host>\d+):(?P<port>\d+)(?:/(?P<proto>tcp))?$")


@dataclass(frozen=True)
class PortSpec:
    host_port: int      # 0: any free port
    port: int
    address: str = "127.0.0.1"

    @classmethod
    def parse(cls, text: str) -> "PortSpec":
        """`[ADDRESS:]HOSTPORT:PORT[/tcp]`, e.g. "8080:80", "0.0.0.0:8080:80",
        "[::1]:8080:80". Only TCP."""
        m = _SPEC.match(text.strip())
        if not m:
            raise ValueError(f"bad published port {text!r}: expected [ADDRESS:]HOSTPORT:PORT (TCP only)")
        address = (m["addr"] or "127.0.0.1").strip("[]")
        ipaddress.ip_address(address)  # raises ValueError on a bad address
        host_port, port = int(m["host"]), int(m["port"])
        if not 0 <= host_port < 65536 or not 0 < port < 65536:
            raise ValueError(f"bad published port {text!r}: ports are 1..65535")
        return cls(host_port, port, address)

    def __str__(self) -> str:
        address = f"[{self.address}]" if ":" in self.address else self.address
        return f"{address}:{self.host_port}:{self.port}"


# The host's listening sockets of published ports: a child forked without
# exec closes its copies, so that a port ends with the process serving it.
_listening: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _close_in_child() -> None:
    for sock in list(_listening):
        sock.close()
    _listening.clear()


os.register_at_fork(after_in_child=_close_in_child)


class PublishedPort:
    """A listener on the host forwarding into the sandbox. `await open()`,
    run `serve()` in a task group, cancel it (or `aclose()`) to stop."""

    def __init__(self, spec: PortSpec, ns: Namespaces, *, via: NetHelper | None = None) -> None:
        self.spec = spec
        self.ns = ns
        self.via = via
        self._listener: SocketListener | None = None
        self.host_port = spec.host_port

    async def open(self) -> "PublishedPort":
        """Binds the host's side (a NetError naming the port at once, e.g.
        when another process has it)."""
        family = socket.AF_INET6 if ":" in self.spec.address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.spec.address, self.spec.host_port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            hint = {errno.EADDRINUSE: "another process uses it: publish another host port, or 0 for any free one",
                    errno.EADDRNOTAVAIL: f"{self.spec.address} is not an address of this host",
                    errno.EACCES: "ports below 1024 of the host need privileges: publish one above 1023"}.get(
                        e.errno or 0)
            raise NetError(f"cannot publish port {self.spec}: {e.strerror}", hint=hint) from None
        except BaseException:
            sock.close()
            raise
        self.host_port = sock.getsockname()[1]
        self._listener = await SocketListener.from_socket(sock)
        _listening.add(sock)
        return self

    async def serve(self) -> None:
        """Forwards connections until cancelled, as many at once as a
        sandbox's proxy serves, within the same budget of this process's
        descriptors (each connection holds two)."""
        if self._listener is None:
            await self.open()
        assert self._listener is not None
        await serve_bounded(self._listener, self._forward, MAX_CONNECTIONS)

    async def aclose(self) -> None:
        if self._listener is not None:
            await self._listener.aclose()

    async def _forward(self, client: SocketStream) -> None:
        async with client:
            try:
                inside = await connect_in(self.ns, "127.0.0.1", self.spec.port, via=self.via)
            except (OSError, TimeoutError, NetError):
                return  # nothing listens inside (or no helper): the client sees the connection close
            async with await SocketStream.from_socket(inside) as upstream:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(relay, client, upstream)
                    await relay(upstream, client)
                    tg.cancel_scope.cancel()
