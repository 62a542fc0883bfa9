"""read_file / write_file, resolved inside the sandbox.

A path is never resolved on the host: an absolute symlink in the root
filesystem would point at the host's own files. The init forks a child that
takes the sandbox user's credentials, opens the path with
openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) from inside the sandbox's
root, and passes the open descriptor back. The kernel checks permissions as
the sandbox user, and the bytes then move over that descriptor directly.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Sequence

import anyio

from . import protocol
from .errors import OutputLimitExceeded, SandboxUnavailable
from .exec import SendRequest
from .limits import human_size, read_file_limit

# Above this size the copy runs in a worker thread, off the event loop.
THREAD_THRESHOLD = 1024 * 1024

_STAGE_WORDS = {
    protocol.STAGE_MKDIRS: "creating its parent directories failed",
    protocol.STAGE_CREDS: "switching to the sandbox user failed",
    protocol.STAGE_SPAWN: "the sandbox could not fork",
    protocol.STAGE_REQUEST: "the sandbox rejected the request",
}


async def open_path(send: SendRequest, creds: protocol.Creds, path: str, open_flags: int,
                    *, mode: int = 0o666, mkdirs: bool = False) -> tuple[int, bool]:
    """Opens `path` (absolute, inside the sandbox) as `creds`.

    Returns the descriptor and whether it is a directory. Raises OSError
    subclasses (FileNotFoundError, PermissionError, ...) naming the path.
    """
    message, memfd = protocol.encode(
        protocol.OP_OPEN, creds, [os.fsencode(path)],
        flags=protocol.F_MKDIRS if mkdirs else 0, open_flags=open_flags, mode=mode,
    )
    chan, chan_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            fds: Sequence[int] = [chan_child.fileno()] + ([memfd] if memfd is not None else [])
            await send(message, fds)
        finally:
            chan_child.close()
            if memfd is not None:
                os.close(memfd)
        chan.setblocking(False)
        data = b""
        received: list[int] = []
        while len(data) < protocol.REPLY.size:
            await anyio.wait_readable(chan)
            try:
                chunk, fds_in, _, _ = socket.recv_fds(chan, protocol.REPLY.size - len(data), 1)
            except BlockingIOError:
                continue
            received += fds_in
            if not chunk:
                break
            data += chunk
    finally:
        chan.close()
    if len(data) < protocol.REPLY.size:
        for fd in received:
            os.close(fd)
        raise SandboxUnavailable("the sandbox stopped while opening a file")
    reply = protocol.Reply(*protocol.REPLY.unpack(data))
    if reply.kind == protocol.REPLY_FD and received:
        return received[0], reply.code == 1
    for fd in received:
        os.close(fd)
    err = reply.err or errno.EIO
    words = _STAGE_WORDS.get(reply.stage)
    raise OSError(err, os.strerror(err) + (f" ({words})" if words else ""), path)


def _read_all(fd: int, at_most: int) -> bytes:
    chunks = []
    total = 0
    while total < at_most:
        data = os.read(fd, at_most - total)
        if not data:
            break
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _too_large(path: str, limit: int) -> OutputLimitExceeded:
    # Inspect's wording, which its conformance checks look for.
    return OutputLimitExceeded(
        f"The sandbox output stream limit of {human_size(limit)} was exceeded (reading {path}).", limit
    )


async def read_file(send: SendRequest, creds: protocol.Creds, path: str, text: bool) -> str | bytes:
    fd, is_dir = await open_path(send, creds, path, os.O_RDONLY)
    try:
        if is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "Not a regular file", path)
        limit = read_file_limit()
        if st.st_size > limit:
            raise _too_large(path, limit)
        os.set_blocking(fd, True)
        # Files such as /proc entries report size 0; read to EOF, one byte
        # past the limit to notice an overrun.
        if st.st_size > THREAD_THRESHOLD:
            data = await anyio.to_thread.run_sync(_read_all, fd, limit + 1)
        else:
            data = _read_all(fd, limit + 1)
        if len(data) > limit:
            raise _too_large(path, limit)
    finally:
        os.close(fd)
    # Strict decoding (the contract's UnicodeDecodeError); no newline
    # translation, so "\r\n" survives.
    return data.decode("utf-8") if text else data


async def write_file(send: SendRequest, creds: protocol.Creds, path: str, contents: str | bytes) -> None:
    data = contents.encode("utf-8") if isinstance(contents, str) else contents
    fd, _ = await open_path(send, creds, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mkdirs=True)
    try:
        os.set_blocking(fd, True)
        if len(data) > THREAD_THRESHOLD:
            await anyio.to_thread.run_sync(_write_all, fd, data)
        else:
            _write_all(fd, data)
    finally:
        os.close(fd)
