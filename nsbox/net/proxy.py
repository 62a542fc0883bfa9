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
- `*`                 everything (but what follows).
Everything else is refused: HTTP 403 with a body naming the host and the
setting to change, SOCKS5 reply 2 ("not allowed by ruleset").

Names are resolved by this process (the sandbox has no DNS). Whatever the
client asked for, a name or an address literal, the proxy connects only to
addresses it checked, and refuses the host's own: loopback, unspecified
(0.0.0.0 is the host too), link-local, the known cloud metadata addresses
(METADATA), and every address of this host's interfaces (a service bound
to 0.0.0.0 answers on each), IPv4 written as IPv6 (::ffff:127.0.0.1)
included. Such an address is let through only when an allow entry names
that address itself (`allow: ["127.0.0.1:8080"]`), never through a name or
`*`. It connects to the address it checked, so a name whose DNS changes
between the check and the connection (rebinding) cannot swap it. An
explicit `hosts` mapping given to the proxy (`{"name": "127.0.0.1"}`, the
site's NSBOX_PROXY_HOSTS) is trusted as it is.

Bounds. The proxy runs in the nsbox process, whose descriptors every
sandbox shares: each sandbox has at most `max_connections` connections at
once (NSBOX_PROXY_MAX_CONNECTIONS, default 256; further ones wait in the
listen backlog, unaccepted, holding no descriptor of ours), all sandboxes
together at most a quarter of the process's RLIMIT_NOFILE (each connection
is two descriptors; NSBOX_PROXY_MAX_TOTAL overrides), and a client that has
not finished its request within `handshake_timeout` seconds
(NSBOX_PROXY_HANDSHAKE_TIMEOUT, default 30) is dropped.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import resource
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

import anyio
from anyio.abc import ByteStream, SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

DEFAULT_PORT = 3128
MAX_HEAD = 65536
CONNECT_TIMEOUT = 10.0
MAX_CONNECTIONS = 256       # per sandbox (per ProxyServer.serve)
LOOKUPS = 8                 # names a sandbox's proxy resolves at once (see system_resolver)
HANDSHAKE_TIMEOUT = 30.0    # from accept to a connected (or refused) request
# Cloud metadata services outside link-local (169.254/16, fe80::/10, refused
# as such): AWS's IPv6 one, Alibaba's, Oracle's legacy one.
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "fd00:ec2::23", "100.100.100.200", "192.0.0.192"))
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
            if host != "*" and not is_host(name):
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

    def names_address(self, address: str, port: int) -> bool:
        """Whether an entry names this address itself (not a name, not `*`):
        the only way an address of the host or a metadata service is let through."""
        ip = _plain(address)
        return any(_is_ip(r.host) and _plain(r.host) == ip and r.port in (None, port) for r in self._rules)

    def __repr__(self) -> str:
        return f"Allowlist({list(self.entries)!r})"


def _label_ok(label: str) -> bool:
    return 0 < len(label) <= 63 and all(c.isascii() and (c.isalnum() or c in "-_") for c in label)


def is_host(host: str) -> bool:
    """Whether `host` (normalised) is an IP address or an ASCII host name.
    Anything else is refused before the allow-list is read: the resolver
    stops at a NUL, so "evil.test\\0.example.org" would pass a rule for
    *.example.org and reach evil.test."""
    return _is_ip(host) or (0 < len(host) <= 253 and all(_label_ok(x) for x in host.split(".")))


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
    host's resolver, at most LOOKUPS names at a time, in threads of this
    resolver's own: a sandbox asking for names that never resolve holds
    its own threads, not those every other sandbox's proxy looks up with
    (anyio's shared 40)."""
    table = {_normalize(k): v for k, v in (hosts or {}).items()}
    lookups: list[anyio.CapacityLimiter] = []  # made on first use, in the event loop

    async def resolve(host: str, port: int) -> Sequence[tuple[str, bool]]:
        if host in table:
            return [(table[host], True)]
        if _is_ip(host):
            return [(host, False)]  # checked as any resolved address is
        if not lookups:
            lookups.append(anyio.CapacityLimiter(LOOKUPS))
        infos = await anyio.to_thread.run_sync(
            functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM),
            limiter=lookups[0], abandon_on_cancel=True)
        return [(str(info[4][0]), False) for info in infos]

    return resolve


def _plain(address: str) -> "ipaddress.IPv4Address | ipaddress.IPv6Address":
    """The address, an IPv4 one written as IPv6 (::ffff:a.b.c.d, ::a.b.c.d,
    64:ff9b::a.b.c.d) as the IPv4 address it reaches."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped:
            return ip.ipv4_mapped
        value = int(ip)
        if value >> 32 in (0, 0x64FF9B << 64) and value > 1:  # IPv4-compatible, NAT64 well-known prefix
            return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return ip


_own: tuple[float, frozenset[object]] = (0.0, frozenset())
_own_lock = threading.Lock()


def host_addresses() -> frozenset[object]:
    """The addresses this host answers on (this process's network
    namespace), as networks, read from /proc at most once a second: its
    interfaces', and whole local routes (`ip route add local 10.77.0.0/24`
    makes the host answer on every address of it)."""
    global _own
    with _own_lock:
        if time.monotonic() - _own[0] < 1.0:
            return _own[1]
        found: set[object] = set()
        try:
            with open("/proc/net/fib_trie") as f:
                found |= local_routes(f)
        except (OSError, ValueError):
            pass
        try:
            with open("/proc/net/if_inet6") as f:  # IPv6: 32 hex digits first
                for line in f:
                    found.add(ipaddress.ip_network(ipaddress.IPv6Address(int(line.split()[0], 16))))
        except (OSError, ValueError, IndexError):
            pass
        _own = (time.monotonic(), frozenset(found))
        return _own[1]


def local_routes(fib_trie: Iterable[str]) -> set[object]:
    """The local routes of a /proc/net/fib_trie ("|-- ADDR", then "/LEN host
    LOCAL"), as networks."""
    found: set[object] = set()
    last = ""
    for line in fib_trie:
        text = line.strip()
        if text.startswith("|--"):
            last = text[3:].strip()
        elif text.endswith("host LOCAL") and last:
            found.add(ipaddress.ip_network(f"{last}{text.split()[0]}", strict=False))
    return found


def internal_reason(address: str) -> str | None:
    """Why the proxy never connects to `address` unasked (None: it may)."""
    ip = _plain(address)
    if ip.is_loopback:
        return "a loopback address (the host's own services)"
    if ip.is_unspecified:
        return "the unspecified address (the host itself)"
    if ip in METADATA:
        return "a cloud metadata service"
    if ip.is_link_local:
        return "a link-local address (cloud metadata services among them)"
    written = ipaddress.ip_address(address.split("%")[0])
    if any(a in net for net in host_addresses() for a in (ip, written)  # type: ignore[operator]
           if a.version == net.version):  # type: ignore[attr-defined]
        return "an address of this host (its services on 0.0.0.0 answer there)"
    return None


class _Budget:
    """The descriptors all proxies of this process may hold: connections,
    counted across threads and event loops."""

    def __init__(self) -> None:
        self.used = 0
        self._lock = threading.Lock()

    @staticmethod
    def limit() -> int:
        text = os.environ.get("NSBOX_PROXY_MAX_TOTAL")
        if text:
            return max(1, int(text))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        return max(16, soft // 4)  # two descriptors each: half of them

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.limit():
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.used -= 1


BUDGET = _Budget()


async def serve_bounded(listener: SocketListener, handle: Callable[[SocketStream], Awaitable[None]],
                        max_connections: int) -> None:
    """Serves `listener` with `handle` per connection, at most
    `max_connections` at once and within the process's BUDGET: a client
    beyond that waits in the backlog. An accept that fails (EMFILE) is
    tried again later, not the end of the listener. Takes ownership of it."""
    room = anyio.Semaphore(max_connections)

    async def one(client: SocketStream) -> None:
        try:
            await handle(client)
        finally:
            room.release()
            BUDGET.give()

    async with listener, anyio.create_task_group() as tg:
        while True:
            await room.acquire()
            while not BUDGET.take():
                await anyio.sleep(0.05)
            try:
                client = await listener.accept()
            except BaseException as e:
                room.release()
                BUDGET.give()
                if not isinstance(e, OSError):
                    raise
                await anyio.sleep(0.1)  # e.g. EMFILE: try again later
                continue
            tg.start_soon(one, client)


def _setting(name: str, default: float) -> float:
    text = os.environ.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        raise ValueError(f"{name} must be a number, not {text!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, not {text!r}")
    return value


# ---- the server -------------------------------------------------------------

class ProxyServer:
    """An allowlisting HTTP/SOCKS5 proxy; serve() it on any listener."""

    def __init__(self, allow: Allowlist | Iterable[str], *, resolver: Resolver | None = None,
                 hosts: Mapping[str, str] | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                 max_connections: int | None = None, handshake_timeout: float | None = None,
                 connect: Callable[[str, int], Awaitable[SocketStream]] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.allow = allow if isinstance(allow, Allowlist) else Allowlist(allow)
        self.resolver = resolver or system_resolver(hosts)
        self.connect_timeout = connect_timeout
        self.max_connections = int(max_connections or _setting("NSBOX_PROXY_MAX_CONNECTIONS", MAX_CONNECTIONS))
        self.handshake_timeout = handshake_timeout or _setting("NSBOX_PROXY_HANDSHAKE_TIMEOUT", HANDSHAKE_TIMEOUT)
        self.connect = connect or (lambda address, port: anyio.connect_tcp(address, port))
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
        """Accepts only while this proxy and the process have room (see the
        module's doc): a client beyond that waits in the backlog."""
        await serve_bounded(listener, self.handle, self.max_connections)

    async def handle(self, client: ByteStream) -> None:
        """Serves one client connection: its request (within the handshake
        timeout), then the relay."""
        async with client:
            reader = BufferedByteReceiveStream(client)
            upstream = None
            with anyio.move_on_after(self.handshake_timeout):
                try:
                    first = await reader.receive_exactly(1)
                    if first == b"\x05":
                        upstream = await self._socks5(client, reader)
                    else:
                        upstream = await self._http(client, reader, first)
                except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError,
                        anyio.ClosedResourceError, anyio.DelimiterNotFound, OSError):
                    return
                except Exception as e:  # one bad connection must not stop the proxy
                    self._say(f"error: {type(e).__name__}: {e}")
                    return
            if upstream is None:
                return
            async with upstream:
                try:
                    await _relay(client, reader, upstream)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass

    # -- decisions --

    async def check(self, host: str, port: int) -> list[str]:
        """The decision, before any connection: the addresses the proxy may
        connect to for host:port; raises Refused."""
        if not is_host(_normalize(host)):
            self._say(f"denied {host!r}: not a host name")
            raise Refused(400, "Bad Request", f"nsbox proxy: {host!r} is not a host name or an IP address.\n", 4)
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
        usable, refused = [], []
        for address, trusted in addresses:
            why = None if trusted or self.allow.names_address(address, port) else internal_reason(address)
            if why is None:
                usable.append(address)
            else:
                refused.append(f"{address}: {why}")
        if not usable:
            self._say(f"refused {where}: {'; '.join(refused)}")
            raise Refused(403, "Forbidden",
                          f"nsbox proxy: {where} is refused by policy: {'; '.join(refused)}. The proxy connects to "
                          f"such an address only when {SETTING} names the address itself.\n", 2)
        return usable

    async def _open(self, host: str, port: int) -> SocketStream:
        """check(), then a connection to an address it checked; raises Refused."""
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        error: Exception | None = None
        for address in await self.check(host, port):
            try:
                with anyio.fail_after(self.connect_timeout):
                    stream = await self.connect(address, port)
                self._say(f"allowed {where} via {address}")
                return stream
            except (OSError, TimeoutError) as e:
                error = e
        raise Refused(502, "Bad Gateway", f"nsbox proxy: cannot connect to {where}: {error}\n", 5)

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)

    # -- HTTP --

    async def _http(self, client: ByteStream, reader: BufferedByteReceiveStream,
                    first: bytes) -> SocketStream | None:
        """Reads the request and connects; the upstream to relay, or None (answered)."""
        head = first + await reader.receive_until(b"\r\n\r\n", MAX_HEAD)
        lines = head.split(b"\r\n")
        try:
            method, target, version = lines[0].decode("latin-1").split(" ")
        except ValueError:
            await _respond(client, 400, "Bad Request", "nsbox proxy: malformed request line\n")
            return None
        if method == "CONNECT":
            try:
                host, port = _split_host_port(target)
                if port is None:
                    raise ValueError("no port")
            except ValueError:
                await _respond(client, 400, "Bad Request", f"nsbox proxy: bad CONNECT target {target!r}\n")
                return None
            try:
                upstream = await self._open(host, port)
            except Refused as r:
                await _respond(client, r.status, r.reason, r.text)
                return None
            return await _started(upstream, client.send(b"HTTP/1.1 200 Connection established\r\n\r\n"))
        if not target.lower().startswith("http://"):
            await _respond(client, 400, "Bad Request",
                           "nsbox proxy: expected an absolute http:// URI or CONNECT (use https through CONNECT)\n")
            return None
        rest = target[len("http://"):]
        authority, slash, path = rest.partition("/")
        authority = authority.rpartition("@")[2]
        try:
            host, port = _split_host_port(authority)
        except ValueError:
            await _respond(client, 400, "Bad Request", f"nsbox proxy: bad URI {target!r}\n")
            return None
        try:
            upstream = await self._open(host, port or 80)
        except Refused as r:
            await _respond(client, r.status, r.reason, r.text)
            return None
        # Host is the URI's authority (RFC 9112 3.2.2), not the client's
        # header: a server of several sites must not be asked for another.
        headers = [line for line in lines[1:] if line and line.split(b":", 1)[0].strip().lower()
                   not in (*HOP_HEADERS, b"host")]
        request = b"\r\n".join([f"{method} /{path if slash else ''} {version}".encode("latin-1"),
                                b"Host: " + authority.encode("latin-1"), *headers, b"Connection: close", b"", b""])
        return await _started(upstream, upstream.send(request))

    # -- SOCKS5 (RFC 1928) --

    async def _socks5(self, client: ByteStream, reader: BufferedByteReceiveStream) -> SocketStream | None:
        count = (await reader.receive_exactly(1))[0]
        methods = await reader.receive_exactly(count)
        if 0 not in methods:
            await client.send(b"\x05\xff")
            return None
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
            return None
        (port,) = struct.unpack("!H", await reader.receive_exactly(2))
        if version != 5 or command != 1:
            await client.send(_socks_reply(7))  # only CONNECT
            return None
        try:
            upstream = await self._open(host, port)
        except Refused as r:
            await client.send(_socks_reply(r.socks))
            return None
        return await _started(upstream, client.send(_socks_reply(0)))


async def _started(upstream: SocketStream, send: Awaitable[None]) -> SocketStream:
    """The upstream, once `send` is done; closed if that fails or is cancelled."""
    try:
        await send
    except BaseException:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        raise
    return upstream


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
