"""The text of a sandbox's /etc/hosts and /etc/resolv.conf for each network mode.

Names inside sandboxes resolve through /etc/hosts: the sandbox's own name,
`host.nsbox.internal` (the host's loopback, in nat mode where the sandbox
asks for it and on networks that allow it) and the other members of its service networks, by name and
by alias. The caller writes the text into the sandbox and writes it again
when members join or leave.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from typing import Iterable, Sequence

HOST_NAME = "host.nsbox.internal"
SIOCGIFADDR = 0x8915  # <linux/sockios.h>
# A name in /etc/hosts: letters, digits, '-', '_' and '.' (RFC 952/1123 plus '_').
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")


def host_address() -> str | None:
    """The host's own IPv4 address (nat is IPv4 only), or None where it has
    none but loopback and link-local ones. What Docker's host-gateway
    reaches: the host's services on that address or on every address, not
    those on its loopback. The route out's source first (a UDP connect only
    picks the route: nothing is sent), else the first interface's."""
    candidates = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            candidates.append(s.getsockname()[0])
    except OSError:
        pass  # no route out
    candidates += _interface_addresses()
    for text in candidates:
        address = ipaddress.IPv4Address(text)
        if not (address.is_loopback or address.is_unspecified or address.is_link_local):
            return text
    return None


def _interface_addresses() -> list[str]:
    """Each interface's IPv4 address (SIOCGIFADDR), in index order."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            out.append(socket.inet_ntoa(raw[20:24]))
    return out


def check_name(name: str) -> str:
    """Returns `name` if it can stand in /etc/hosts, else raises ValueError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{name!r} cannot be a host name (letters, digits, '-', '_' and '.' only)")
    return name


def check_address(address: str) -> str:
    """`address` as it stands in /etc/hosts (an IPv4 or IPv6 address,
    normalised), else ValueError. A scope id (fe80::1%eth0) is refused:
    Python takes anything after the '%', newlines too."""
    ip = ipaddress.ip_address(address)
    if getattr(ip, "scope_id", None) is not None:
        raise ValueError(f"{address!r}: an address with a scope id (%...) cannot stand in /etc/hosts")
    return str(ip)


def render_hosts(hostname: str, peers: Iterable[tuple[str, Sequence[str]]] = (),
                 host_address: str | None = None, own_address: str | None = None,
                 aliases: Sequence[str] = ()) -> str:
    """/etc/hosts for a sandbox called `hostname`.

    peers: (address, [name, alias...]) of the other members of its networks.
    host_address: where the host's loopback is reachable (nat: the gateway).
    own_address: the sandbox's address on a network (else 127.0.1.1).
    aliases: its own other names there (as Docker's DNS answers them to it too).
    """
    own = [check_name(hostname), *(check_name(a) for a in dict.fromkeys(aliases) if a != hostname)]
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{check_address(own_address) if own_address else '127.0.1.1'}\t{' '.join(own)}"]
    if host_address:
        lines.append(f"{check_address(host_address)}\t{HOST_NAME}")
    for address, names in peers:
        names = [check_name(n) for n in names if n != hostname]
        if names:
            lines.append(f"{check_address(address)}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def render_resolv_conf(nameserver: str | None) -> str:
    """/etc/resolv.conf: the user-mode network's DNS forwarder, or none at all."""
    if nameserver is None:
        return "# nsbox: no DNS in this network mode; names resolve through /etc/hosts\n"
    return f"nameserver {nameserver}\noptions edns0\n"
