"""Receiving descriptors over a Unix socket, close-on-exec.

socket.recv_fds() takes a flags argument but does not pass it on (CPython
3.11–3.13), so the descriptors it returns survive an exec: a program this
process runs (os.system, a subprocess with close_fds=False) would inherit
a sandbox's init pidfd, a socket bound inside a sandbox, a file of one.
"""

from __future__ import annotations

import array
import socket


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
    """(data, descriptors) of one message; the descriptors close-on-exec."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(bufsize, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)
