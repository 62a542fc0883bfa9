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


def test_a_port_that_cannot_be_published_is_named() -> None:
    """Another process has it: one line naming the port and what to do, no
    traceback, nothing left (it had been a raw OSError traceback)."""
    import subprocess
    import sys

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        async def start() -> None:
            with pytest.raises(nsbox.NsboxError, match=f"cannot publish port 127.0.0.1:{port}:80: Address already in use"
                               ) as e:
                async with nsbox.Sandbox(ports=[f"{port}:80"]):
                    pass
            assert e.value.hint is not None and "0 for any free one" in e.value.hint

        anyio.run(start)
        r = subprocess.run([sys.executable, "-m", "nsbox", "run", "-p", f"{port}:80", "--", "true"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 125 and f"cannot publish port 127.0.0.1:{port}:80" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        held.close()
