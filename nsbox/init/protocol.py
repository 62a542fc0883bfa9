"""Packing and unpacking the messages of csrc/common/protocol.h.

The constants come from the header itself (through cffi), and the struct
layouts below are checked against the C compiler's sizes at import.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from dataclasses import dataclass
from typing import Sequence

from .._native import ffi, lib

REQUEST = struct.Struct("=10I")
REPLY = struct.Struct("=4i")
STATUS = struct.Struct("=IIQII")
SIGNAL = struct.Struct("=i")

for _py, _c in ((REQUEST, "struct nsbox_request"), (REPLY, "struct nsbox_reply"), (STATUS, "struct nsbox_status")):
    if _py.size != ffi.sizeof(_c):
        raise ImportError(f"nsbox: {_c} is {ffi.sizeof(_c)} bytes in C but {_py.size} in Python")

OP_EXEC = lib.NSBOX_OP_EXEC
OP_OPEN = lib.NSBOX_OP_OPEN
OP_DETACH = lib.NSBOX_OP_DETACH
OP_STATUS = lib.NSBOX_OP_STATUS
OP_SHUTDOWN = lib.NSBOX_OP_SHUTDOWN

F_PAYLOAD_FD = lib.NSBOX_F_PAYLOAD_FD
F_MKDIRS = lib.NSBOX_F_MKDIRS
F_SETGROUPS = lib.NSBOX_F_SETGROUPS
F_SETCTTY = lib.NSBOX_F_SETCTTY
F_DETACHED = lib.NSBOX_F_DETACHED
F_NO_STARTED = lib.NSBOX_F_NO_STARTED
F_REGULAR = lib.NSBOX_F_REGULAR
F_RESTART = lib.NSBOX_F_RESTART
F_RESTART_ON_FAILURE = lib.NSBOX_F_RESTART_ON_FAILURE
STATUS_SHARED_SPAWN = lib.NSBOX_STATUS_SHARED_SPAWN

REPLY_EXIT = lib.NSBOX_REPLY_EXIT
REPLY_FAIL = lib.NSBOX_REPLY_FAIL
REPLY_FD = lib.NSBOX_REPLY_FD
# Never compared in Python: on an EXEC channel any reply but FAIL means the
# command started (InitClient.spawn; Channel.answered, where an EXIT may come
# in the same read as its STARTED, or alone under F_NO_STARTED). Named so that
# every reply of protocol.h has its name here.
REPLY_STARTED = lib.NSBOX_REPLY_STARTED

STAGE_REQUEST = lib.NSBOX_STAGE_REQUEST
STAGE_SPAWN = lib.NSBOX_STAGE_SPAWN
STAGE_CWD = lib.NSBOX_STAGE_CWD
STAGE_CREDS = lib.NSBOX_STAGE_CREDS
STAGE_EXEC = lib.NSBOX_STAGE_EXEC
STAGE_MKDIRS = lib.NSBOX_STAGE_MKDIRS
STAGE_OPEN = lib.NSBOX_STAGE_OPEN
STAGE_HELPER = lib.NSBOX_STAGE_HELPER
STAGE_KERNEL_FS = lib.NSBOX_STAGE_KERNEL_FS

MSG_MAX = lib.NSBOX_MSG_MAX


@dataclass(frozen=True)
class Creds:
    """Who a request runs as, inside the sandbox."""

    uid: int
    gid: int
    groups: tuple[int, ...] | None  # None: leave supplementary groups alone


@dataclass(frozen=True)
class Reply:
    kind: int
    code: int
    err: int
    stage: int


def _strings(items: Sequence[bytes]) -> bytes:
    for s in items:
        if b"\0" in s:
            raise ValueError(f"argument contains a NUL byte: {s[:40]!r}")
    return b"\0".join(items) + b"\0"


def encode(op: int, creds: Creds, strings: Sequence[bytes], *, argc: int = 0, envc: int = 0,
           flags: int = 0, open_flags: int = 0, mode: int = 0) -> tuple[bytes, int | None]:
    """Returns the control message and, when the payload is too large to go
    inline, a memfd holding it (to be attached as the last descriptor)."""
    groups = creds.groups or ()
    if creds.groups is not None:
        flags |= F_SETGROUPS
    payload = struct.pack(f"={len(groups)}I", *groups) + _strings(strings)
    memfd = None
    if REQUEST.size + len(payload) > MSG_MAX:
        flags |= F_PAYLOAD_FD
        memfd = os.memfd_create("nsbox-request", os.MFD_CLOEXEC)
        view = memoryview(payload)
        while view:
            view = view[os.write(memfd, view):]
    header = REQUEST.pack(op, flags, creds.uid, creds.gid, len(groups), argc, envc,
                          open_flags, mode, len(payload))
    return (header if memfd is not None else header + payload), memfd


def send(sock: socket.socket, message: bytes, fds: Sequence[int]) -> None:
    """Sends one control message; raises BlockingIOError if the socket is full."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([message], anc)


def parse_replies(buf: bytearray) -> list[Reply]:
    """Takes every complete reply off the front of `buf`."""
    out = []
    while len(buf) >= REPLY.size:
        out.append(Reply(*REPLY.unpack_from(buf)))
        del buf[: REPLY.size]
    return out
