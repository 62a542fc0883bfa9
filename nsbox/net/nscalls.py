"""Low-level calls shared by the network helper (helper.py) and the bridge
worker (bridge_worker.py): namespace system calls and the reply framing.
Standard library only: both run as plain scripts, outside the nsbox package.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from typing import Any

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MAX_MESSAGE = 65536
MAX_FDS = 16

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int, what: str) -> None:
    _check(libc.setns(fd, nstype), f"joining the {what}")


def unshare(flags: int, what: str) -> None:
    _check(libc.unshare(flags), f"creating a {what}")


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
