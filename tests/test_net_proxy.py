"""The `proxy` network mode: the allowlist, and the proxy reached from a real
sandbox's loopback through a listener made inside its network namespace.

Every server here binds to 127.0.0.1 of the host; the names the sandbox asks
for are mapped to it by the proxy's `hosts` table. Nothing leaves the machine.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

import anyio
import pytest
from anyio.abc import SocketStream

import nsbox
from nsbox.net.client import Namespaces, listen_in
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


async def _upstream(stream: SocketStream) -> None:
    """A tiny HTTP/1.1 server: answers every request with its request line."""
    async with stream:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive()
            data += chunk
        line = data.split(b"\r\n")[0].decode()
        headers = data.split(b"\r\n\r\n")[0].decode().lower()
        body = json.dumps({"line": line, "close": "connection: close" in headers}).encode()
        await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))


@pytest.fixture
async def upstream_port() -> AsyncIterator[int]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, _upstream)
        yield port
        tg.cancel_scope.cancel()


# Runs inside the sandbox with the host's python3: urllib honours http_proxy;
# CONNECT and SOCKS5 are spoken by hand.
CLIENT = r"""
import json, socket, struct, sys, urllib.request, urllib.error
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "http":
    try:
        r = urllib.request.urlopen(f"http://{host}:{port}/hello", timeout=10)
        print(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        print(e.code, e.read().decode())
elif mode == "connect":
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    status = int(head.split()[1])
    if status != 200:
        print(status, s.recv(65536).decode())
        sys.exit()
    s.sendall(f"GET /tunnel HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    print(status, data.split(b"\r\n\r\n", 1)[1].decode())
elif mode == "socks":
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"\x05\x01\x00")
    assert s.recv(2) == b"\x05\x00"
    name = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
    reply = s.recv(10)
    if reply[1] != 0:
        print("socks", reply[1])
        sys.exit()
    s.sendall(f"GET /socks HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    print("socks", 0, data.split(b"\r\n\r\n", 1)[1].decode())
"""


@pytest.fixture
async def proxied() -> AsyncIterator[nsbox.Sandbox]:
    """A sandbox (network "none") whose loopback port 3128 is the proxy,
    allowing allowed.test and *.good.test, both mapped to the host's 127.0.0.1."""
    server = ProxyServer(["allowed.test", "*.good.test"],
                         hosts={"allowed.test": "127.0.0.1", "www.good.test": "127.0.0.1",
                                "denied.test": "127.0.0.1"})
    async with nsbox.Sandbox(env=proxy_env()) as sb:
        ns = Namespaces.of_pid(sb.pid)
        try:
            sock = await listen_in(ns, "127.0.0.1", 3128)
        finally:
            ns.close()
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve_socket, sock)
            yield sb
            tg.cancel_scope.cancel()


async def _client(sb: nsbox.Sandbox, mode: str, host: str, port: int) -> str:
    r = await sb.exec(["python3", "-c", CLIENT, mode, host, str(port)], timeout=30)
    assert r.success, r.stderr
    return r.stdout.strip()


async def test_plain_http_allowed_and_refused(proxied: nsbox.Sandbox, upstream_port: int) -> None:
    out = await _client(proxied, "http", "allowed.test", upstream_port)
    status, body = out.split(" ", 1)
    assert status == "200"
    assert json.loads(body) == {"line": "GET /hello HTTP/1.1", "close": True}
    out = await _client(proxied, "http", "denied.test", upstream_port)
    assert out.startswith("403 ")
    assert f"denied.test:{upstream_port} is not allowed" in out
    assert "allowed.test, *.good.test" in out and "`allow` setting" in out


async def test_connect_allowed_and_refused(proxied: nsbox.Sandbox, upstream_port: int) -> None:
    out = await _client(proxied, "connect", "www.good.test", upstream_port)
    assert out.startswith("200 ") and "GET /tunnel" in out
    out = await _client(proxied, "connect", "good.test", upstream_port)  # the domain itself is not listed
    assert out.startswith("403 ") and "good.test" in out


async def test_socks5_allowed_and_refused(proxied: nsbox.Sandbox, upstream_port: int) -> None:
    out = await _client(proxied, "socks", "allowed.test", upstream_port)
    assert out.startswith("socks 0 ") and "GET /socks" in out
    assert await _client(proxied, "socks", "denied.test", upstream_port) == "socks 2"


async def test_the_sandbox_reaches_nothing_else(proxied: nsbox.Sandbox, upstream_port: int) -> None:
    """Without the proxy the host's loopback stays out of reach."""
    r = await proxied.exec(["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {upstream_port}), timeout=2)"])
    assert not r.success and "Connection refused" in r.stderr


async def test_names_resolving_to_loopback_are_refused() -> None:
    async def resolver(host: str, port: int) -> list[tuple[str, bool]]:
        return [("127.0.0.1", False), ("169.254.169.254", False)]

    server = ProxyServer(["*.evil.test"], resolver=resolver)
    with pytest.raises(Refused, match="loopback or link-local"):
        await server._open("x.evil.test", 80)
