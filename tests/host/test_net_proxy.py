"""The `proxy` network mode: the proxy reached from a real sandbox's loopback
through a listener made inside its network namespace (the allowlist and the
refusals on their own are tests/unit/net/test_proxy.py).

Every server here binds to 127.0.0.1 of the host; the names the sandbox asks
for are mapped to it by the proxy's `hosts` table. Nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import anyio
import pytest
from anyio.abc import SocketStream

import nsbox
from nsbox.net.client import Namespaces, listen_in
from nsbox.net.proxy import ProxyServer, proxy_env

pytestmark = pytest.mark.timeout(60)


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
elif mode == "get":  # by hand: urllib would not use the proxy for NO_PROXY's 127.0.0.1
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(f"GET http://{host}:{port}/hello HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    print(int(data.split()[1]), data.split(b"\r\n\r\n", 1)[1].decode())
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
elif mode in ("socks", "socks-ipv4"):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"\x05\x01\x00")
    assert s.recv(2) == b"\x05\x00"
    name = host.encode()
    if mode == "socks":
        s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
    else:
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + struct.pack("!H", port))
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


async def _only_loopback(address: str, port: int) -> SocketStream:
    """The proxies of these tests connect to the host's 127.0.0.1 at most."""
    if address != "127.0.0.1":
        raise AssertionError(f"the proxy tried to connect to {address}:{port}")
    return await anyio.connect_tcp(address, port)


@pytest.fixture
async def open_proxied(upstream_port: int) -> AsyncIterator[nsbox.Sandbox]:
    """A sandbox whose proxy allows everything (`*`), and 127.0.0.1 on the
    upstream's port by its address."""
    server = ProxyServer(["*", f"127.0.0.1:{upstream_port}"], connect=_only_loopback)
    refusing = ProxyServer(["*"], connect=_only_loopback)
    async with nsbox.Sandbox(env=proxy_env()) as sb:
        ns = Namespaces.of_pid(sb.pid)
        try:
            socks = [await listen_in(ns, "127.0.0.1", port) for port in (3128, 3129)]
        finally:
            ns.close()
        async with anyio.create_task_group() as tg:
            tg.start_soon(refusing.serve_socket, socks[0])
            tg.start_soon(server.serve_socket, socks[1])
            yield sb
            tg.cancel_scope.cancel()


async def test_allow_all_does_not_reach_the_hosts_loopback(open_proxied: nsbox.Sandbox, upstream_port: int) -> None:
    for mode, host in [("connect", "127.0.0.1"), ("connect", "[::ffff:127.0.0.1]"), ("get", "[::ffff:127.0.0.1]"),
                       ("get", "127.0.0.1"), ("connect", "0.0.0.0"), ("connect", "169.254.169.254"),
                       ("connect", "[fd00:ec2::254]"), ("connect", "100.100.100.200")]:
        out = await _client(open_proxied, mode, host, upstream_port)
        assert out.startswith("403 ") and "refused by policy" in out, (mode, host, out)
    assert await _client(open_proxied, "socks-ipv4", "127.0.0.1", upstream_port) == "socks 2"
    assert await _client(open_proxied, "socks-ipv4", "169.254.169.254", 80) == "socks 2"
    # The proxy on 3129 names 127.0.0.1:PORT itself: that one address gets through.
    r = await open_proxied.exec(["sh", "-c", f"sed 's/3128/3129/' > /tmp/c.py; python3 /tmp/c.py connect 127.0.0.1 "
                                             f"{upstream_port}"], input=CLIENT, timeout=30)
    assert r.stdout.startswith("200 ") and "GET /tunnel" in r.stdout, r


OWN_ADDRESS = r"""
import socket, subprocess, sys, anyio
from nsbox.net.proxy import ProxyServer, internal_reason

def ask(port, target):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    data = s.recv(4096)
    while b" 403 " in data.split(b"\r\n")[0] and (chunk := s.recv(4096)):
        data += chunk
    return data.decode().replace("\r\n", " ")

async def main():
    server = socket.create_server(("0.0.0.0", 0))  # a host service on every address
    port = server.getsockname()[1]
    assert socket.gethostbyname("own.test") == "198.51.100.7"
    print("reason", internal_reason("198.51.100.7"))
    async with anyio.create_task_group() as tg:
        for proxy_port, allow in ((3128, ["*"]), (3129, ["198.51.100.7"])):
            tg.start_soon(ProxyServer(allow).serve_socket, socket.create_server(("127.0.0.1", proxy_port)))
        for proxy_port, target in ((3128, "own.test"), (3128, "198.51.100.7"), (3129, "198.51.100.7")):
            print(proxy_port, target, await anyio.to_thread.run_sync(ask, proxy_port, f"{target}:{port}"))
        tg.cancel_scope.cancel()

anyio.run(main)
"""


@pytest.mark.needs("iproute2")
def test_names_and_literals_of_the_hosts_own_addresses_are_refused(tmp_path: Path) -> None:
    """In a network namespace of the test's own, with an address
    (198.51.100.7, on its lo) standing for the host's eth0 address: a name resolving to it (through
    /etc/hosts, bound over in the test's mount namespace) and the literal
    are refused, as a service bound to 0.0.0.0 answers there; named
    exactly in the allowlist, it is reached."""
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n198.51.100.7 own.test\n")
    (tmp_path / "own.py").write_text(OWN_ADDRESS)
    script = (f"ip link set lo up && ip addr add 198.51.100.7/32 dev lo && mount --bind {tmp_path}/hosts /etc/hosts && exec {sys.executable} {tmp_path}/own.py")
    r = subprocess.run(["unshare", "-r", "-n", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert lines[0] == "reason an address of this host (its services on 0.0.0.0 answer there)", r.stdout
    assert lines[1].startswith("3128 own.test HTTP/1.1 403") and "refused by policy" in lines[1], r.stdout
    assert lines[2].startswith("3128 198.51.100.7 HTTP/1.1 403"), r.stdout
    assert lines[3].startswith("3129 198.51.100.7 HTTP/1.1 200"), r.stdout


async def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


HOLD = r"""
import socket, sys, time
held = [socket.create_connection(("127.0.0.1", 3128)) for _ in range(int(sys.argv[1]))]
time.sleep(2)
held[0].settimeout(10)
start = time.monotonic()
try:
    got = held[0].recv(1)
    print("eof" if got == b"" else "data", round(time.monotonic() - start))
except socket.timeout:
    print("still open")
"""


async def test_one_sandbox_cannot_pin_the_hosts_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy-mode sandbox opening many idle connections: the nsbox process
    accepts at most NSBOX_PROXY_MAX_CONNECTIONS of them (the rest wait in
    the sandbox's backlog), and drops those that send no request within
    NSBOX_PROXY_HANDSHAKE_TIMEOUT."""
    monkeypatch.setenv("NSBOX_PROXY_MAX_CONNECTIONS", "8")
    monkeypatch.setenv("NSBOX_PROXY_HANDSHAKE_TIMEOUT", "1")
    async with nsbox.Sandbox(network="proxy", allow=["*"]) as sb:
        # What a first exec opens and keeps (its connection, the loop's
        # pooled epolls) is not the proxy's: run alone, it counted.
        await sb.exec(["true"])
        before = await _fds()
        peak = before
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, await _fds())
                    await anyio.sleep(0.05)
            tg.start_soon(watch)
            r = await sb.exec(["python3", "-c", HOLD, "100"], timeout=40)
            tg.cancel_scope.cancel()
        assert r.success, r.stderr
        assert peak - before <= 8 + 4, (before, peak)
        assert r.stdout.startswith("eof"), r.stdout
