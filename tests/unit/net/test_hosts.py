"""nsbox/net/hosts.py: what may stand in a sandbox's /etc/hosts."""

from __future__ import annotations

import pytest

from nsbox.net.hosts import check_address, render_hosts
from nsbox.spec import SandboxSpec

pytestmark = pytest.mark.timeout(30)

# Python parses anything after an IPv6 address's '%' as its scope id.
FORGED = "fe80::1%x\n203.0.113.9 pypi.org"


def test_addresses_are_normalised() -> None:
    assert check_address("10.1.2.3") == "10.1.2.3"
    assert check_address("0:0::1") == "::1"
    with pytest.raises(ValueError):
        check_address("10.1.2.3 extra")


def test_a_scope_id_cannot_add_lines() -> None:
    """An entry's address with a scope id is refused where a sandbox's
    settings are checked, and where the file is written: a newline in it
    had added any line to /etc/hosts."""
    with pytest.raises(ValueError, match="scope id"):
        SandboxSpec(hosts={"ok": FORGED})
    with pytest.raises(ValueError, match="scope id"):
        render_hosts("box", [(FORGED, ["peer"])])
    with pytest.raises(ValueError, match="scope id"):
        render_hosts("box", host_address=FORGED)
    text = render_hosts("box", [("10.1.2.3", ["peer", "alias"])], host_address="10.0.2.2")
    assert text.splitlines()[-2:] == ["10.0.2.2\thost.nsbox.internal", "10.1.2.3\tpeer alias"]
