"""The egress proxy of the `proxy` network mode, with an allowlist.

The sandbox keeps a loopback-only network namespace. A listening socket on
the sandbox's own loopback (127.0.0.1:3128 by default) is created *inside*
its namespace by the network helper and handed to this process, which
accepts on it directly: no process runs in the sandbox for it, and nothing
else connects the sandbox to the outside. `proxy_env()` is the environment
that points the sandbox's programs at it.

It speaks:
- HTTP CONNECT (`CONNECT host:port HTTP/1.1`: https, or any TCP protocol
  a client tunnels through an HTTP proxy);
- plain HTTP with an absolute URI (`GET http://host/path HTTP/1.1`), sent
  on as one request per connection (`Connection: close`);
- SOCKS5 (no authentication, CONNECT only, names resolved here: the
  `socks5h://` form).

Allowlist semantics (`allow: [...]`, matched on the host name the client
asked for, case-insensitively, a trailing dot ignored):
- `example.com`       that host, any port; not its subdomains.
- `*.example.org`     any subdomain of example.org, at any depth
                      (`a.example.org`, `a.b.example.org`), not example.org
                      itself (list both to allow both).
- `example.com:443`, `*.example.org:8080`   the same, on that port only.
- `192.0.2.7`, `[2001:db8::1]:443`          an IP address the client asked
                      for literally (no name matches it).
- `*`                 everything.
Everything else is refused: HTTP 403 with a body naming the host and the
setting to change, SOCKS5 reply 2 ("not allowed by ruleset").

Names are resolved by this process (the sandbox has no DNS). A name that
resolves only to loopback, link-local (cloud metadata services among them)
or unspecified addresses is refused even when allowed, so an allowed domain
whose DNS someone controls cannot reach the host's own services; an
explicit `hosts` mapping given to the proxy (`{"name": "127.0.0.1"}`) is
trusted as it is.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

import anyio
from anyio.abc import ByteStream, SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

DEFAULT_PORT = 3128
MAX_HEAD = 65536
CONNECT_TIMEOUT = 10.0
# Hop-by-hop headers a proxy must not pass on (RFC 9110 7.6.1).
HOP_HEADERS = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
               b"proxy-authenticate", b"te", b"trailer", b"upgrade"}
SETTING = "the sandbox's `allow` setting (nsbox.yaml `allow:`, CLI `--allow`)"


def proxy_env(port: int = DEFAULT_PORT, host: str = "127.0.0.1") -> dict[str, str]:
    """The environment that points a sandbox's programs at the proxy.

    ALL_PROXY uses SOCKS5 with names resolved by the proxy, for programs
    (curl, git) that send other protocols through it."""
    http = f"http://{host}:{port}"
    socks = f"socks5h://{host}:{port}"
    env = {"HTTP_PROXY": http, "HTTPS_PROXY": http, "ALL_PROXY": socks,
           "NO_PROXY": "localhost,127.0.0.1,::1"}
    return {**env, **{k.lower(): v for k, v in env.items()}}


# ---- allowlist ------------------------------------------------------------

@dataclass(frozen=True)
class _Rule:
    host: str        # a name, "*.suffix", an IP address, or "*"
    port: int | None


def _normalize(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _split_host_port(text: str) -> tuple[str, int | None]:
    """"host", "host:port", "[v6]", "[v6]:port", "v6" (no port)."""
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"unbalanced '[' in {text!r}")
        rest = text[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after ']' in {text!r}")
        return text[1:end], (_port(rest[1:], text) if rest else None)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _port(port, text)
    return text, None


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port in {whole!r}")
    return int(text)


class Allowlist:
    """Which destinations the proxy lets through (see the module's doc)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(entries)
        rules = []
        for entry in self.entries:
            if not isinstance(entry, str) or not entry.strip():
                raise ValueError(f"allow entries must be non-empty strings, not {entry!r}")
            host, port = _split_host_port(entry)
            host = _normalize(host)
            name = host[2:] if host.startswith("*.") else host
            if host != "*" and not _is_ip(host) and not all(_label_ok(x) for x in name.split(".")):
                raise ValueError(f"allow entry {entry!r} is not a host name, '*.domain', an IP address or '*'")
            rules.append(_Rule(host, port))
        self._rules = tuple(rules)

    def allows(self, host: str, port: int) -> bool:
        host = _normalize(host)
        for rule in self._rules:
            if rule.port is not None and rule.port != port:
                continue
            if rule.host == "*" or rule.host == host:
                return True
            if rule.host.startswith("*.") and not _is_ip(host) and host.endswith(rule.host[1:]):
                return True
        return False

    def __repr__(self) -> str:
        return f"Allowlist({list(self.entries)!r})"


def _label_ok(label: str) -> bool:
    return 0 < len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


# ---- resolution -----------------------------------------------------------

class Refused(Exception):
    """The destination is not allowed or cannot be reached; the text says why."""

    def __init__(self, status: int, reason: str, text: str, socks: int) -> None:
        super().__init__(text)
        self.status, self.reason, self.text, self.socks = status, reason, text, socks


# (host, port) -> addresses to try, each with "trusted" (may be loopback).
Resolver = Callable[[str, int], Awaitable[Sequence[tuple[str, bool]]]]


def system_resolver(hosts: Mapping[str, str] | None = None) -> Resolver:
    """Resolves through `hosts` (name -> address, trusted) first, then the
    host's resolver."""
    table = {_normalize(k): v for k, v in (hosts or {}).items()}

    async def resolve(host: str, port: int) -> Sequence[tuple[str, bool]]:
        if host in table:
            return [(table[host], True)]
        if _is_ip(host):
            return [(host, True)]  # asked for literally, and allowed literally
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return [(str(info[4][0]), False) for info in infos]

    return resolve


def _internal(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified


# ---- the server -------------------------------------------------------------

class ProxyServer:
    """An allowlisting HTTP/SOCKS5 proxy; serve() it on any listener."""

    def __init__(self, allow: Allowlist | Iterable[str], *, resolver: Resolver | None = None,
                 hosts: Mapping[str, str] | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                 log: Callable[[str], None] | None = None) -> None:
        self.allow = allow if isinstance(allow, Allowlist) else Allowlist(allow)
        self.resolver = resolver or system_resolver(hosts)
        self.connect_timeout = connect_timeout
        self.log = log

    async def serve_socket(self, sock: socket.socket) -> None:
        """Serves a listening socket (e.g. the one made inside the sandbox)
        until cancelled. Takes ownership of it."""
        sock.setblocking(False)
        await self.serve(await SocketListener.from_socket(sock))

    async def serve_unix(self, path: str | os.PathLike[str]) -> None:
        """Serves a unix socket at `path` (mode 0600) until cancelled."""
        listener = await anyio.create_unix_listener(path, mode=0o600)
        await self.serve(listener)

    async def serve(self, listener: SocketListener) -> None:
        async with listener:
            await listener.serve(self.handle)

    async def handle(self, client: ByteStream) -> None:
        """Serves one client connection."""
        async with client:
            reader = BufferedByteReceiveStream(client)
            try:
                first = await reader.receive_exactly(1)
            except (anyio.IncompleteRead, anyio.EndOfStream, OSError, anyio.BrokenResourceError):
                return
            try:
                if first == b"\x05":
                    await self._socks5(client, reader)
                else:
                    await self._http(client, reader, first)
            except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError,
                    anyio.ClosedResourceError, anyio.DelimiterNotFound, ConnectionError):
                return
            except Exception as e:  # one bad connection must not stop the proxy
                self._say(f"error: {type(e).__name__}: {e}")

    # -- decisions --

    async def _open(self, host: str, port: int) -> SocketStream:
        """The allowlist check, then a connection; raises Refused."""
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if not self.allow.allows(host, port):
            self._say(f"denied {where}")
            raise Refused(403, "Forbidden",
                          f"nsbox proxy: {where} is not allowed. Allowed: {', '.join(self.allow.entries) or '(nothing)'}."
                          f" To allow it, add {host if ':' not in host else f'[{host}]'} to {SETTING}.\n", 2)
        try:
            addresses = await self.resolver(_normalize(host), port)
        except OSError as e:
            raise Refused(502, "Bad Gateway", f"nsbox proxy: cannot resolve {host}: {e}\n", 4) from None
        usable = [a for a, trusted in addresses if trusted or not _internal(a)]
        if not usable:
            raise Refused(403, "Forbidden", f"nsbox proxy: {host} resolves to a loopback or link-local address "
                                            f"({', '.join(a for a, _ in addresses)}), which the proxy never connects to\n", 2)
        error: Exception | None = None
        for address in usable:
            try:
                with anyio.fail_after(self.connect_timeout):
                    stream = await anyio.connect_tcp(address, port)
                self._say(f"allowed {where} via {address}")
                return stream
            except (OSError, TimeoutError) as e:
                error = e
        raise Refused(502, "Bad Gateway", f"nsbox proxy: cannot connect to {where}: {error}\n", 5)

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)

    # -- HTTP --

    async def _http(self, client: ByteStream, reader: BufferedByteReceiveStream, first: bytes) -> None:
        head = first + await reader.receive_until(b"\r\n\r\n", MAX_HEAD)
        lines = head.split(b"\r\n")
        try:
            method, target, version = lines[0].decode("latin-1").split(" ")
        except ValueError:
            await _respond(client, 400, "Bad Request", "nsbox proxy: malformed request line\n")
            return
        if method == "CONNECT":
            try:
                host, port = _split_host_port(target)
                if port is None:
                    raise ValueError("no port")
            except ValueError:
                await _respond(client, 400, "Bad Request", f"nsbox proxy: bad CONNECT target {target!r}\n")
                return
            try:
                upstream = await self._open(host, port)
            except Refused as r:
                await _respond(client, r.status, r.reason, r.text)
                return
            async with upstream:
                await client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await _relay(client, reader, upstream)
            return
        if not target.lower().startswith("http://"):
            await _respond(client, 400, "Bad Request",
                           "nsbox proxy: expected an absolute http:// URI or CONNECT (use https through CONNECT)\n")
            return
        rest = target[len("http://"):]
        authority, slash, path = rest.partition("/")
        authority = authority.rpartition("@")[2]
        try:
            host, port = _split_host_port(authority)
        except ValueError:
            await _respond(client, 400, "Bad Request", f"nsbox proxy: bad URI {target!r}\n")
            return
        try:
            upstream = await self._open(host, port or 80)
        except Refused as r:
            await _respond(client, r.status, r.reason, r.text)
            return
        headers = [line for line in lines[1:] if line and line.split(b":", 1)[0].strip().lower() not in HOP_HEADERS]
        request = b"\r\n".join([f"{method} /{path if slash else ''} {version}".encode("latin-1"), *headers,
                                b"Connection: close", b"", b""])
        async with upstream:
            await upstream.send(request)
            await _relay(client, reader, upstream)

    # -- SOCKS5 (RFC 1928) --

    async def _socks5(self, client: ByteStream, reader: BufferedByteReceiveStream) -> None:
        count = (await reader.receive_exactly(1))[0]
        methods = await reader.receive_exactly(count)
        if 0 not in methods:
            await client.send(b"\x05\xff")
            return
        await client.send(b"\x05\x00")
        version, command, _, kind = await reader.receive_exactly(4)
        if kind == 1:
            host = socket.inet_ntop(socket.AF_INET, await reader.receive_exactly(4))
        elif kind == 4:
            host = socket.inet_ntop(socket.AF_INET6, await reader.receive_exactly(16))
        elif kind == 3:
            size = (await reader.receive_exactly(1))[0]
            host = (await reader.receive_exactly(size)).decode("ascii", errors="replace")
        else:
            await client.send(_socks_reply(8))
            return
        (port,) = struct.unpack("!H", await reader.receive_exactly(2))
        if version != 5 or command != 1:
            await client.send(_socks_reply(7))  # only CONNECT
            return
        try:
            upstream = await self._open(host, port)
        except Refused as r:
            await client.send(_socks_reply(r.socks))
            return
        async with upstream:
            await client.send(_socks_reply(0))
            await _relay(client, reader, upstream)


def _socks_reply(code: int) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


async def _respond(client: ByteStream, status: int, reason: str, body: str) -> None:
    data = body.encode()
    await client.send(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\nX-Nsbox-Proxy: refused\r\n\r\n".encode() + data)


async def _relay(client: ByteStream, reader: BufferedByteReceiveStream, upstream: SocketStream) -> None:
    """Copies both ways until both sides have finished sending."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay, reader, upstream)  # what the reader holds comes first
        await relay(upstream, client)
        # The upstream finished its answer: stop waiting for the client too.
        tg.cancel_scope.cancel()


async def relay(source: "BufferedByteReceiveStream | ByteStream", sink: ByteStream) -> None:
    try:
        while True:
            await sink.send(await source.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
        pass
    try:
        await sink.send_eof()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, NotImplementedError):
        pass
