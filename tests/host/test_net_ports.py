"""Published ports: a host listener on 127.0.0.1 forwarding into a sandbox's
network namespace through sockets the network helper connects inside."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import anyio
import pytest

import nsbox
from nsbox.net.client import Namespaces
from nsbox.net.ports import PortSpec, PublishedPort

from tests.net_members import Member

pytestmark = pytest.mark.timeout(60)


def test_port_specs() -> None:
    assert PortSpec.parse("8080:80") == PortSpec(8080, 80, "127.0.0.1")
    assert PortSpec.parse("0.0.0.0:8080:80/tcp") == PortSpec(8080, 80, "0.0.0.0")
    assert PortSpec.parse("[::1]:8080:80") == PortSpec(8080, 80, "::1")
    assert str(PortSpec.parse("[::1]:8080:80")) == "[::1]:8080:80"
    for bad in ["80", "a:80", "8080:0", "70000:80", "1.2.3:8080:80", "8080:80/udp", "host:8080:80"]:
        with pytest.raises(ValueError):
            PortSpec.parse(bad)


def _fetch(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        data = b""
        while chunk := c.recv(65536):
            data += chunk
        return data


@pytest.mark.parametrize("inside", ["127.0.0.1", "0.0.0.0"])
async def test_published_port_reaches_a_server_inside(inside: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        member = Member(None, Path(tmp), "web")
        try:
            server = member.serve("from inside", inside)
            published = await PublishedPort(PortSpec(0, 8000), member.ns).open()
            assert published._listener is not None
            assert published._listener.extra(anyio.abc.SocketAttribute.local_address)[0] == "127.0.0.1"
            async with anyio.create_task_group() as tg:
                tg.start_soon(published.serve)
                for _ in range(3):
                    assert await anyio.to_thread.run_sync(_fetch, published.host_port) == b"from inside"
                tg.cancel_scope.cancel()
            server.kill()
            server.wait()
        finally:
            member.close()


async def test_nothing_listening_inside_closes_the_connection() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        member = Member(None, Path(tmp), "web")
        try:
            published = await PublishedPort(PortSpec(0, 8000), member.ns).open()
            async with anyio.create_task_group() as tg:
                tg.start_soon(published.serve)
                assert await anyio.to_thread.run_sync(_fetch, published.host_port) == b""
                tg.cancel_scope.cancel()
        finally:
            member.close()


async def test_published_port_of_a_real_sandbox() -> None:
    async with nsbox.Sandbox() as sb:
        await sb.exec(["sh", "-c", "python3 -m http.server --bind 127.0.0.1 8000 >/dev/null 2>&1 &"])
        ns = Namespaces.of_pid(sb.pid)
        try:
            published = await PublishedPort(PortSpec.parse("0:8000"), ns).open()
            async with anyio.create_task_group() as tg:
                tg.start_soon(published.serve)
                for _ in range(100):
                    with socket.create_connection(("127.0.0.1", published.host_port), timeout=10) as c:
                        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                        reply = await anyio.to_thread.run_sync(c.recv, 100)
                    if reply:
                        break
                    await anyio.sleep(0.05)
                assert reply.startswith(b"HTTP/1.0 200")
                tg.cancel_scope.cancel()
        finally:
            ns.close()
