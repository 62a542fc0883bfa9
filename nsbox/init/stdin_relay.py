"""A host stdin for a sandboxed command, as bytes only.

A descriptor passed into a sandbox is the host's open file: a sandbox
process can reopen it through /proc/self/fd/0, for writing too, chmod it,
or walk up from a directory to the host's whole tree. So only an anonymous
pipe, which names nothing on the host, is passed as it is; anything else
(a file `< script.sh`, a named FIFO, a socket) is copied into a fresh pipe
by a thread, which stops when the command is done with it.
"""

from __future__ import annotations

import os
import select
import threading

CHUNK = 1 << 16


def is_anonymous_pipe(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


class StdinRelay:
    """`fd` for the command to read: `source` itself if that is safe to
    pass, else a pipe fed from it (`devnull` for no source). close() once
    the command has exited."""

    def __init__(self, source: int | None, devnull: int) -> None:
        self._thread: threading.Thread | None = None
        if source is None or is_anonymous_pipe(source):
            self.fd, self._write, self._stop = devnull if source is None else source, -1, (-1, -1)
            return
        self.fd, self._write = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._write, False)  # a write waits in poll, where a stop is heard too
        self._stop = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._copy, args=(source,), daemon=True, name="nsbox-stdin")
        self._thread.start()

    def _copy(self, source: int) -> None:
        reading = select.poll()
        reading.register(source, select.POLLIN)
        reading.register(self._stop[0], select.POLLIN)
        writing = select.poll()
        writing.register(self._write, select.POLLOUT)
        writing.register(self._stop[0], select.POLLIN)
        try:
            while True:
                if self._stop[0] in {fd for fd, _ in reading.poll()}:
                    return
                data = memoryview(os.read(source, CHUNK))
                if not data:
                    return
                while data:  # as the command reads; a sandbox process may hold the pipe and never read
                    if self._stop[0] in {fd for fd, _ in writing.poll()}:
                        return
                    try:
                        data = data[os.write(self._write, data):]
                    except BlockingIOError:
                        continue
        except OSError:  # EPIPE: no one reads it any more
            return
        finally:
            os.close(self._write)  # the command sees EOF

    def close(self) -> None:
        """The command has exited: a copy still waiting on the source or on
        the pipe ends at once, even where a process the command left holds
        the pipe (the stop pipe wakes both waits)."""
        if self._thread is None:
            return
        os.close(self.fd)
        os.write(self._stop[1], b"x")
        self._thread.join()
        for fd in self._stop:
            os.close(fd)
        self._thread = None
