"""User-mode networking started on a namespace's first frame out.

pasta costs ~30 ms of CPU and ~20 MiB of memory at start, and most members
of a service network never reach past their peers. So the bridge worker
(bridge_worker.py) makes, at a member's join, the tap device pasta would
make and configures it as pasta would; the network helper (helper.py)
holds it and starts pasta only when the namespace sends the tap its first
frame.

No packet of the sandbox's is lost on the way:

- The gateway and DNS addresses get permanent neighbour entries, so the
  first frame out is the packet itself (a SYN, a DNS query), not an ARP
  request the kernel would repeat only a second later.
- The device is persistent: closing our descriptor detaches us and leaves
  the device, its address, route and neighbours in place for pasta to
  attach to. (A tap takes one reader at a time: pasta cannot attach while
  we hold it. Neighbour entries flushed when the carrier drops in between
  are all but the permanent ones.)
- The frames read before pasta attached are sent out of the tap again, from
  a packet socket bound to it inside the namespace, opened while standing
  by: pasta reads them as if the sandbox had just sent them. Nothing in them
  is parsed here. Frames sent while pasta starts (~20 ms) are dropped, as on
  any link: TCP sends them again.

Plain script module, standard library only: make_tap() runs in the bridge
worker, inside the member's network namespace; read_frames() and
send_frames() in the helper.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import time

from nscalls import configure, no_ipv6

TUNSETIFF, TUNSETPERSIST = 0x400454CA, 0x400454CB
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
SIOCSIFMTU, SIOCADDRT, SIOCSARP = 0x8922, 0x890B, 0x8955
RTF_UP, RTF_GATEWAY = 0x1, 0x2
ATF_COM, ATF_PERM = 0x02, 0x04
ARPHRD_ETHER = 1
SOL_PACKET, PACKET_QDISC_BYPASS = 263, 20
# The link-layer address the sandbox sends its gateway's and DNS's frames
# to. pasta answers whatever address a frame carries; this one is locally
# administered (and is the one pasta itself uses by default).
GATEWAY_MAC = bytes.fromhex("9a559a559a55")
MAX_FRAMES = 64  # read before pasta attaches and sent again; TCP repeats anything beyond
FRAME_SIZE = 65536 + 14
SEND_PATIENCE = 0.5  # seconds for the attached pasta's tap to accept the frames


class RouteEntry(ctypes.Structure):
    """struct rtentry (SIOCADDRT)."""

    _fields_ = [("pad1", ctypes.c_ulong), ("dst", ctypes.c_ubyte * 16), ("gateway", ctypes.c_ubyte * 16),
                ("genmask", ctypes.c_ubyte * 16), ("flags", ctypes.c_ushort), ("pad2", ctypes.c_short),
                ("pad3", ctypes.c_ulong), ("pad4", ctypes.c_void_p), ("metric", ctypes.c_short),
                ("dev", ctypes.c_char_p), ("mtu", ctypes.c_ulong), ("window", ctypes.c_ulong),
                ("irtt", ctypes.c_ushort)]


def _sockaddr(address: str) -> bytes:
    return struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(address))


def _sockaddr_field(address: str) -> ctypes.Array[ctypes.c_ubyte]:
    return (ctypes.c_ubyte * 16).from_buffer_copy(_sockaddr(address))


def _netmask(prefix: int) -> str:
    return socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF))


def make_tap(ifname: str, address: str, prefix: int, gateway: str, dns: str, mtu: int) -> list[int]:
    """In the sandbox's namespaces: the persistent tap, configured as pasta's
    --config-net would (address, default route via the gateway; IPv4 only),
    plus the gateway's and DNS's permanent neighbour entries. Returns its
    descriptor (non-blocking) and a packet socket bound to it, for sending."""
    name = ifname.encode()
    tap = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(tap, TUNSETIFF, struct.pack("16sH22x", name, IFF_TAP | IFF_NO_PI))
        fcntl.ioctl(tap, TUNSETPERSIST, 1)
        no_ipv6(ifname)  # no router solicitations: the first frame out is the sandbox's
        configure(ifname, address, _netmask(prefix))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s, SIOCSIFMTU, struct.pack("16si20x", name, mtu))
            for neighbour in (gateway, dns):
                hw = struct.pack("H6s8x", ARPHRD_ETHER, GATEWAY_MAC)
                fcntl.ioctl(s, SIOCSARP, _sockaddr(neighbour) + hw + struct.pack("i", ATF_COM | ATF_PERM)
                            + bytes(16) + struct.pack("16s", name))
            route = RouteEntry(dst=_sockaddr_field("0.0.0.0"), gateway=_sockaddr_field(gateway),
                               genmask=_sockaddr_field("0.0.0.0"), flags=RTF_UP | RTF_GATEWAY, dev=name)
            fcntl.ioctl(s, SIOCADDRT, route)
        sender = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: receives nothing
        try:
            sender.bind((ifname, 0))
            # Straight to the device: its queueing discipline is switched
            # back on only a moment after pasta attaches.
            sender.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
        except BaseException:
            sender.close()
            raise
    except BaseException:
        os.close(tap)
        raise
    return [tap, sender.detach()]


def read_frames(tap: int) -> list[bytes]:
    """The frames waiting on the tap (at most MAX_FRAMES)."""
    frames: list[bytes] = []
    while len(frames) < MAX_FRAMES:
        try:
            frames.append(os.read(tap, FRAME_SIZE))
        except BlockingIOError:
            break
    return frames


def send_frames(sender: int, frames: list[bytes]) -> int:
    """Sends the frames out of the tap, to the program now attached to it;
    returns how many went. Waits briefly while the device has no carrier
    yet (ENOBUFS, ENETDOWN)."""
    deadline = time.monotonic() + SEND_PATIENCE
    sent = 0
    for frame in frames:
        while True:
            try:
                os.write(sender, frame)
                sent += 1
                break
            except OSError as e:
                if e.errno not in (errno.ENOBUFS, errno.ENETDOWN) or time.monotonic() > deadline:
                    return sent
                time.sleep(0.001)
    return sent
