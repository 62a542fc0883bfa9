"""The `proxy` network mode's decisions (nsbox/net/proxy.py): the allowlist,
and the refusals made before any connection; tests/host/test_net_proxy.py
has the proxy reached from real sandboxes."""

from __future__ import annotations

import pytest
from anyio.abc import SocketStream

from nsbox.net.proxy import Allowlist, ProxyServer, Refused, proxy_env

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
