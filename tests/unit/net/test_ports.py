"""Published ports' specs (nsbox/net/ports.py); tests/host/test_net_ports.py
has the forwarding itself."""

from __future__ import annotations

import pytest

from nsbox.net.ports import PortSpec

pytestmark = pytest.mark.timeout(60)


def test_port_specs() -> None:
    assert PortSpec.parse("8080:80") == PortSpec(8080, 80, "127.0.0.1")
    assert PortSpec.parse("0.0.0.0:8080:80/tcp") == PortSpec(8080, 80, "0.0.0.0")
    assert PortSpec.parse("[::1]:8080:80") == PortSpec(8080, 80, "::1")
    assert str(PortSpec.parse("[::1]:8080:80")) == "[::1]:8080:80"
    for bad in ["80", "a:80", "8080:0", "70000:80", "1.2.3:8080:80", "8080:80/udp", "host:8080:80"]:
        with pytest.raises(ValueError):
            PortSpec.parse(bad)
