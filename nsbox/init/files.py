"""read_file / write_file, resolved inside the sandbox.

A path is never resolved on the host: an absolute symlink in the root
filesystem would point at the host's own files. The init forks a child that
takes the sandbox user's credentials, opens the path with
openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) from inside the sandbox's
root, and passes the open descriptor back (InitClient.open). The kernel
checks permissions as the sandbox user, and the bytes then move over that
descriptor directly, only ever from or to a regular file.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable, TypeVar

import anyio

from . import protocol
from .client import InitClient
from ..errors import OutputLimitExceeded
from .output_limits import human_size, read_file_limit

# Above this size the copy runs in a worker thread, off the event loop.
THREAD_THRESHOLD = 1024 * 1024
T = TypeVar("T")
# Longest a copy may take: nothing the sandbox does may keep a host call
# waiting forever (opening has its own bound, client.OPEN_TIMEOUT).
COPY_TIMEOUT = 600.0


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


async def _copy(fn: Callable[..., T], *args: object, size: int, path: str) -> T:
    """Runs a copy over a descriptor the sandbox handed us: small ones on
    the event loop, large ones in a worker thread, none for longer than
    COPY_TIMEOUT (a thread still blocked then is abandoned, not waited for)."""
    if size <= THREAD_THRESHOLD:
        return fn(*args)
    with anyio.move_on_after(COPY_TIMEOUT) as scope:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
    assert scope.cancelled_caught
    raise TimeoutError(errno.ETIMEDOUT, f"copying the file took more than {COPY_TIMEOUT:g}s", path)


def _too_large(path: str, limit: int) -> OutputLimitExceeded:
    # Inspect's wording, which its conformance checks look for.
    return OutputLimitExceeded(
        f"The sandbox output stream limit of {human_size(limit)} was exceeded (reading {path}).", limit
    )


async def read_file(client: InitClient, creds: protocol.Creds, path: str, text: bool,
                    limit: int | None = None) -> str | bytes:
    """The file's contents, up to `limit` bytes (the read_file limit by
    default; OutputLimitExceeded beyond it)."""
    fd, is_dir = await client.open(creds, path, os.O_RDONLY)
    try:
        if is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "Not a regular file", path)
        limit = read_file_limit() if limit is None else limit
        if st.st_size > limit:
            raise _too_large(path, limit)
        os.set_blocking(fd, True)
        # Files such as /proc entries report size 0; read to EOF, one byte
        # past the limit to notice an overrun.
        data = await _copy(_read_all, fd, limit + 1, size=st.st_size, path=path)
        if len(data) > limit:
            raise _too_large(path, limit)
    finally:
        os.close(fd)
    # Strict decoding (the contract's UnicodeDecodeError); no newline
    # translation, so "\r\n" survives.
    return data.decode("utf-8") if text else data


async def write_file(client: InitClient, creds: protocol.Creds, path: str, contents: str | bytes) -> None:
    data = contents.encode("utf-8") if isinstance(contents, str) else contents
    fd, _ = await client.open(creds, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mkdirs=True)
    try:
        # The init checked the type; a descriptor from the sandbox is
        # checked again before we block on it.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Not a regular file", path)
        os.set_blocking(fd, True)
        await _copy(_write_all, fd, data, size=len(data), path=path)
    finally:
        os.close(fd)
