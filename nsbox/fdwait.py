"""Waiting for several file descriptors at once on the running event loop.

An exec watches up to four descriptors (stdout, stderr, the reply channel,
stdin). Spawning a task per descriptor costs more than the whole exec of a
short command, so on asyncio the poller registers plain reader and writer
callbacks that wake a single future. Other event loops (trio) get a generic
version built from anyio.wait_readable / wait_writable.
"""

from __future__ import annotations

import asyncio
import select

import anyio


def readable_now(fd: int) -> bool:
    """Whether `fd` is readable (or hung up) right now, without waiting: an
    exited process's pidfd, a socket whose peer is gone. poll, not select:
    the descriptor may be above 1023."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class Poller:
    """Level-triggered readiness for a changing set of descriptors.

    A descriptor wait() reports was ready when it returned; POLLHUP and
    POLLERR count as ready (the read or write then says what happened).
    """

    def __init__(self) -> None:
        self._read: set[int] = set()
        self._write: set[int] = set()
        self._ready: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (trio)
            self._loop = None

    def watch(self, fd: int, read: bool = False, write: bool = False) -> None:
        """Sets what to wait for on `fd`; neither forgets it (which must
        happen before it is closed)."""
        loop = self._loop
        if read and fd not in self._read:
            self._read.add(fd)
            if loop is not None:
                loop.add_reader(fd, self._fire, fd)
        elif not read and fd in self._read:
            self._read.discard(fd)
            if loop is not None:
                loop.remove_reader(fd)
        if write and fd not in self._write:
            self._write.add(fd)
            if loop is not None:
                loop.add_writer(fd, self._fire, fd)
        elif not write and fd in self._write:
            self._write.discard(fd)
            if loop is not None:
                loop.remove_writer(fd)
        if not read and not write:
            self._ready.discard(fd)

    def want_read(self, fd: int) -> None:
        self.watch(fd, read=True, write=fd in self._write)

    def want_write(self, fd: int) -> None:
        self.watch(fd, read=fd in self._read, write=True)

    def forget(self, fd: int) -> None:
        self.watch(fd)

    def close(self) -> None:
        for fd in list(self._read | self._write):
            self.forget(fd)

    def _fire(self, fd: int) -> None:
        self._ready.add(fd)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> set[int]:
        """Returns the descriptors that are ready (at least one)."""
        while True:
            if not self._ready:
                if self._loop is not None:
                    self._waiter = self._loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                else:
                    await self._wait_generic()
            ready, self._ready = self._ready, set()
            if self._loop is None:
                return ready
            # The loop may run a reader callback it queued before our last
            # read: confirm, or a blocking descriptor would block on it.
            ready = self._confirm(ready)
            if ready:
                return ready

    def _confirm(self, fds: set[int]) -> set[int]:
        p = select.poll()
        for fd in fds:
            p.register(fd, (select.POLLIN if fd in self._read else 0) | (select.POLLOUT if fd in self._write else 0))
        return {fd for fd, _ in p.poll(0)}

    async def _wait_generic(self) -> None:
        if not self._read and not self._write:
            # Nothing to wait for: block like the asyncio path does, rather
            # than return no descriptor to a caller that loops on wait().
            await anyio.sleep_forever()

        async def watch(fd: int, wait, scope: anyio.CancelScope) -> None:  # type: ignore[no-untyped-def]
            await wait(fd)
            self._ready.add(fd)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            for fd in self._read:
                tg.start_soon(watch, fd, anyio.wait_readable, tg.cancel_scope)
            for fd in self._write:
                tg.start_soon(watch, fd, anyio.wait_writable, tg.cancel_scope)
