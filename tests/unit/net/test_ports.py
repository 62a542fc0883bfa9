"""Published ports' specs (nsbox/net/ports.py); tests/host/test_net_ports.py
has the forwarding itself."""

from __future__ import annotations

import socket

import anyio
import pytest
from anyio.abc import SocketListener, SocketStream

from nsbox.net import ports
from nsbox.net.ports import PortSpec, PublishedPort

pytestmark = pytest.mark.timeout(60)


def test_port_specs() -> None:
    assert PortSpec.parse("8080:80") == PortSpec(8080, 80, "127.0.0.1")
    assert PortSpec.parse("0.0.0.0:8080:80/tcp") == PortSpec(8080, 80, "0.0.0.0")
    assert PortSpec.parse("[::1]:8080:80") == PortSpec(8080, 80, "::1")
    assert str(PortSpec.parse("[::1]:8080:80")) == "[::1]:8080:80"
    for bad in ["80", "a:80", "8080:0", "70000:80", "1.2.3:8080:80", "8080:80/udp", "host:8080:80"]:
        with pytest.raises(ValueError):
            PortSpec.parse(bad)


async def test_a_published_port_outlives_accept_errors_and_bounds_its_connections(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An accept that fails (a flood that used up the descriptors: EMFILE)
    is tried again: it had ended the port, and with it every port and the
    proxy of the sandbox, for good. At most MAX_CONNECTIONS are served at
    once (as the proxy serves them); the next waits in the backlog."""
    import errno

    accepts: list[str] = []
    active, most = [0], [0]
    gate = anyio.Event()

    class Listener(SocketListener):
        async def accept(self) -> SocketStream:
            accepts.append("call")
            if len(accepts) == 1:
                raise OSError(errno.EMFILE, "Too many open files")
            return f"client{len(accepts)}"  # type: ignore[return-value]

        async def aclose(self) -> None:
            pass

        @property
        def _raw_socket(self) -> socket.socket:  # type: ignore[override]
            raise NotImplementedError

    async def forward(client: object) -> None:
        active[0] += 1
        most[0] = max(most[0], active[0])
        try:
            await gate.wait()
        finally:  # cancelled at the end too
            active[0] -= 1

    monkeypatch.setattr(ports, "MAX_CONNECTIONS", 2)
    port = PublishedPort(PortSpec.parse("0:80"), None)  # type: ignore[arg-type]
    port._listener = Listener()
    monkeypatch.setattr(port, "_forward", forward)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(port.serve)
            while active[0] < 2:
                await anyio.sleep(0.01)
            await anyio.sleep(0.3)
            assert (len(accepts), active[0]) == (3, 2)  # the error, then two; the third waits
            gate.set()
            while len(accepts) < 6:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert most[0] == 2
