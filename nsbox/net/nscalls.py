"""Low-level calls shared by the network helper (helper.py) and the bridge
worker (bridge_worker.py, ondemand.py): namespace system calls, interface
configuration and the reply framing. Standard library only: both run as
plain scripts, outside the nsbox package.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import struct
from typing import Any

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MAX_MESSAGE = 65536
MAX_FDS = 16
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFADDR, SIOCSIFNETMASK = 0x8913, 0x8914, 0x8916, 0x891C
IFF_UP = 0x1

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int, what: str) -> None:
    _check(libc.setns(fd, nstype), f"joining the {what}")


def unshare(flags: int, what: str) -> None:
    _check(libc.unshare(flags), f"creating a {what}")


def configure(ifname: str, address: str, netmask: str = "255.255.255.0") -> None:
    """Addresses (a /24 unless told) and raises an interface of the namespace
    this process is in, and its loopback (plain ioctls: no second netlink
    socket)."""

    def ifreq_addr(addr: str) -> bytes:
        return struct.pack("16sHH4s8x", ifname.encode(), socket.AF_INET, 0, socket.inet_aton(addr))

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFADDR, ifreq_addr(address))
        fcntl.ioctl(s, SIOCSIFNETMASK, ifreq_addr(netmask))
        for name in (ifname, "lo"):
            flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", name.encode(), 0)))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", name.encode(), flags | IFF_UP))


def no_ipv6(*which: str) -> None:
    """IPv6 off for these interface settings (`all`, `default` or a device)
    of the current network namespace."""
    for name in which:
        try:
            with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as f:
                f.write("1")
        except FileNotFoundError:
            return  # a kernel without IPv6: nothing to turn off


def describe(e: BaseException) -> str:
    """An exception as the one-line error a reply carries."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror if not e.filename else f"{e.filename}: {e.strerror}"
    return f"{type(e).__name__}: {e}"


def send_reply(chan: socket.socket, message: dict[str, Any], fds: list[int], seq: Any) -> None:
    """One reply: the message with the request's sequence number (a client
    whose earlier request was cancelled tells that late reply from the one
    it waits for), plus descriptors."""
    data = json.dumps({**message, "seq": seq}).encode()
    if fds:
        socket.send_fds(chan, [data], fds)
    else:
        chan.send(data)
