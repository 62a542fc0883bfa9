"""Waiting for several file descriptors at once on the running event loop.

An exec watches up to four descriptors (stdout, stderr, the reply channel,
stdin). Spawning a task per descriptor costs more than the whole exec of a
short command, so on asyncio the poller registers plain reader and writer
callbacks that wake a single future. Other event loops (trio) get a generic
version built from anyio.wait_readable / wait_writable.
"""

from __future__ import annotations

import asyncio

import anyio


class Poller:
    """Level-triggered readiness for a changing set of descriptors."""

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

    def want_read(self, fd: int) -> None:
        self._read.add(fd)
        if self._loop is not None:
            self._loop.add_reader(fd, self._fire, fd)

    def want_write(self, fd: int) -> None:
        self._write.add(fd)
        if self._loop is not None:
            self._loop.add_writer(fd, self._fire, fd)

    def forget(self, fd: int) -> None:
        """Stops watching `fd`; must be called before it is closed."""
        if fd in self._read:
            self._read.discard(fd)
            if self._loop is not None:
                self._loop.remove_reader(fd)
        if fd in self._write:
            self._write.discard(fd)
            if self._loop is not None:
                self._loop.remove_writer(fd)
        self._ready.discard(fd)

    def close(self) -> None:
        for fd in list(self._read | self._write):
            self.forget(fd)

    def _fire(self, fd: int) -> None:
        self._ready.add(fd)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> set[int]:
        """Returns the descriptors that became ready (at least one)."""
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
        return ready

    async def _wait_generic(self) -> None:
        async def watch(fd: int, wait, scope: anyio.CancelScope) -> None:  # type: ignore[no-untyped-def]
            await wait(fd)
            self._ready.add(fd)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            for fd in self._read:
                tg.start_soon(watch, fd, anyio.wait_readable, tg.cancel_scope)
            for fd in self._write:
                tg.start_soon(watch, fd, anyio.wait_writable, tg.cancel_scope)
