"""The `proxy` network mode's decisions (nsbox/net/proxy.py): the allowlist,
and the refusals made before any connection; tests/host/test_net_proxy.py
has the proxy reached from real sandboxes."""

from __future__ import annotations

import ipaddress
import socket
import threading

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

from nsbox.net.proxy import Allowlist, ProxyServer, Refused, local_routes, proxy_env, system_resolver

pytestmark = pytest.mark.timeout(60)


def test_allowlist_semantics() -> None:
    allow = Allowlist(["example.com", "*.example.org", "api.test:8443", "192.0.2.7", "[2001:db8::1]:443"])
    assert allow.allows("example.com", 80) and allow.allows("EXAMPLE.com.", 443)
    assert not allow.allows("www.example.com", 80)
    assert allow.allows("a.example.org", 1) and allow.allows("a.b.example.org", 1)
    assert not allow.allows("example.org", 80) and not allow.allows("badexample.org", 80)
    assert allow.allows("api.test", 8443) and not allow.allows("api.test", 443)
    assert allow.allows("192.0.2.7", 22) and not allow.allows("192.0.2.8", 22)
    assert allow.allows("2001:db8::1", 443) and not allow.allows("2001:db8::1", 80)
    assert Allowlist(["*"]).allows("anything.at.all", 1)
    assert not Allowlist([]).allows("example.com", 80)
    for bad in ["", "exa mple.com", "example.com:0", "example.com:http", "[::1"]:
        with pytest.raises(ValueError):
            Allowlist([bad])


def test_proxy_env_points_at_loopback() -> None:
    env = proxy_env(3128)
    assert env["HTTP_PROXY"] == env["https_proxy"] == "http://127.0.0.1:3128"
    assert env["ALL_PROXY"] == "socks5h://127.0.0.1:3128"


async def test_names_resolving_to_loopback_are_refused() -> None:
    async def resolver(host: str, port: int) -> list[tuple[str, bool]]:
        return [("127.0.0.1", False), ("169.254.169.254", False)]

    server = ProxyServer(["*.evil.test"], resolver=resolver, connect=_no_connect)
    with pytest.raises(Refused, match="refused by policy: 127.0.0.1: a loopback address.*169.254.169.254: a cloud"):
        await server._open("x.evil.test", 80)


async def _no_connect(address: str, port: int) -> SocketStream:
    raise AssertionError(f"the proxy tried to connect to {address}:{port}")


HOST_AND_METADATA = ["127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1", "::127.0.0.1", "64:ff9b::7f00:1",
                     "0.0.0.0", "::", "169.254.169.254", "fe80::1", "fd00:ec2::254", "100.100.100.200",
                     "192.0.0.192", "127.1"]


@pytest.mark.parametrize("host", HOST_AND_METADATA)
async def test_the_host_and_metadata_services_are_refused_before_any_connection(host: str) -> None:
    """With `*`, literals are checked as resolved names are (127.1 is
    resolved by getaddrinfo's numeric parsing, without DNS): the decision
    refuses them, and no connection is attempted."""
    server = ProxyServer(["*"], connect=_no_connect)
    with pytest.raises(Refused, match="refused by policy") as e:
        await server.check(host, 80)
    assert e.value.status == 403 and e.value.socks == 2
    with pytest.raises(Refused, match="refused by policy"):
        await server._open(host, 80)
    if host == "127.1":
        return  # a name, not an address: it never names one
    # Named exactly, an address is let through (port too, when given).
    assert await ProxyServer([f"[{host}]:80" if ":" in host else f"{host}:80"]).check(host, 80) == [host]
    with pytest.raises(Refused):
        await ProxyServer([f"[{host}]:81" if ":" in host else f"{host}:81", "*"]).check(host, 80)


@pytest.mark.parametrize("host", ["evil.test\x00.example.org", "evil.test\n.example.org", "\x00.example.org",
                                  "évil.example.org", "a..example.org", "evil test.example.org"])
async def test_what_is_no_host_name_is_refused_before_the_allowlist(host: str) -> None:
    """The resolver stops at a NUL: "evil.test\\0.example.org" passed a
    rule for *.example.org and reached evil.test."""
    looked_up: list[str] = []

    async def resolver(name: str, port: int) -> list[tuple[str, bool]]:
        looked_up.append(name)
        return [("192.0.2.1", False)]

    server = ProxyServer(["*.example.org", "*"], resolver=resolver, connect=_no_connect)
    with pytest.raises(Refused, match="is not a host name or an IP address") as e:
        await server._open(host, 443)
    assert e.value.status == 400 and looked_up == []


async def test_a_slow_lookup_of_one_proxy_leaves_the_others_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names that never resolve, asked by one sandbox's proxy, hold that
    proxy's own lookup threads only: another proxy's lookup is answered at
    once (it had waited for anyio's 40 shared threads, 30 s)."""
    release = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host: str | bytes, *args: object, **kwargs: object) -> object:
        if (host.decode() if isinstance(host, bytes) else host).startswith("slow"):
            release.wait(30)
        return real("127.0.0.1", *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    hostile, other = system_resolver(), system_resolver()
    try:
        async with anyio.create_task_group() as tg:
            for i in range(60):
                tg.start_soon(hostile, f"slow{i}.test", 443)
            await anyio.sleep(0.2)
            with anyio.fail_after(5):
                assert await other("fast.test", 443) == [("127.0.0.1", False)]
            release.set()
    finally:
        release.set()


def test_local_routes_are_whole_networks() -> None:
    """`ip route add local 10.77.0.0/24 dev lo` makes the host answer on
    every address of it (only 10.77.0.0 had been taken for the host's)."""
    fib = ["Local:", "  +-- 10.77.0.0/24 2 0 2", "     |-- 10.77.0.0", "        /24 host LOCAL",
           "     |-- 127.0.0.1", "        /32 host LOCAL", "     |-- 192.0.2.0", "        /24 link UNICAST"]
    assert local_routes(fib) == {ipaddress.ip_network("10.77.0.0/24"), ipaddress.ip_network("127.0.0.1/32")}


async def test_plain_http_carries_the_uris_host_not_the_clients() -> None:
    """RFC 9112 3.2.2: the proxy sends the authority it checked as Host. It
    had passed the client's on, so a server of several sites (a CDN) could
    be asked, through an allowed name, for a site not allowed."""
    received: list[bytes] = []

    async def upstream(stream: SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            received.append(data)
            await stream.send(b"HTTP/1.0 200 OK\r\n\r\nok")

    up = (await anyio.create_tcp_listener(local_host="127.0.0.1")).listeners[0]
    px = (await anyio.create_tcp_listener(local_host="127.0.0.1")).listeners[0]
    up_port, px_port = up.extra(SocketAttribute.local_port), px.extra(SocketAttribute.local_port)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(up.serve, upstream)
            tg.start_soon(ProxyServer([f"127.0.0.1:{up_port}"]).serve, px)
            async with await anyio.connect_tcp("127.0.0.1", px_port) as client:
                await client.send(f"GET http://127.0.0.1:{up_port}/x HTTP/1.1\r\nHost: forbidden.test\r\n"
                                  "Accept: */*\r\n\r\n".encode())
                reply = b""
                try:
                    while True:
                        reply += await client.receive()
                except anyio.EndOfStream:
                    pass
            tg.cancel_scope.cancel()
    assert reply.endswith(b"ok"), reply
    assert received[0].split(b"\r\n")[:3] == [b"GET /x HTTP/1.1", f"Host: 127.0.0.1:{up_port}".encode(),
                                              b"Accept: */*"], received
    assert b"forbidden" not in received[0]
