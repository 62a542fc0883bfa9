"""Waiting for several file descriptors at once on the running event loop.

An exec watches up to four descriptors (stdout, stderr, the reply channel,
stdin). Spawning a task per descriptor costs more than the whole exec of a
short command, and so does registering each one with the event loop: the
poller keeps its descriptors in an epoll instance of its own, and the event
loop watches that one descriptor. Readiness comes from the epoll itself,
so a descriptor wait() reports is ready when it returns. A sandbox's execs
reuse their epoll instances, already registered with the loop, through
the PollerPool of the process (POLLERS).
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import select

import anyio

from ..errors import ResourceExhausted


def readable_now(fd: int) -> bool:
    """Whether `fd` is readable (or hung up) right now, without waiting: an
    exited process's pidfd, a socket whose peer is gone. poll, not select:
    the descriptor may be above 1023."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


async def write_all(fd: int, data: bytes | memoryview) -> None:
    """Writes all of `data` to non-blocking `fd` (a pipe), waiting while it
    is full; BrokenPipeError once its reader is gone."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view[: 1 << 20]) :]
        except BlockingIOError:
            await anyio.wait_writable(fd)


async def readable(fd: int, timeout: float | None = None) -> bool:
    """Waits until `fd` is readable (or hung up); False if `timeout` seconds
    passed first. On asyncio a reader callback, a future and a timer:
    anyio's wait_readable and a cancel scope around it cost more than the
    rest of what the host does to create or close a sandbox."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        if timeout is None:
            await anyio.wait_readable(fd)
            return True
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(fd)
            return True
        return False
    waiter = loop.create_future()
    loop.add_reader(fd, _expire, waiter, True)
    timer = None if timeout is None else loop.call_later(timeout, _expire, waiter, False)
    try:
        return await waiter
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def _watches_used_up() -> ResourceExhausted:
    """The kernel counts epoll watches per user, whoever's process holds
    them: a sandbox's processes, as sandbox root is this user (or, as root,
    an id all sandboxes share), can take them all."""
    try:
        with open("/proc/sys/fs/epoll/max_user_watches") as f:
            limit = f" ({f.read().strip()})"
    except OSError:
        limit = ""
    return ResourceExhausted(f"cannot watch a sandbox's streams: this user's epoll watches are used up{limit}",
                             hint="close the sandboxes, or stop the processes, that hold many (a sandbox's count "
                                  "as this user's), or raise it: `sudo sysctl -w fs.epoll.max_user_watches=N`",
                             limit="fs.epoll.max_user_watches")


class _LoopEpoll:
    """An epoll instance the asyncio loop watches, and the poller it wakes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.epoll = select.epoll()
        self.poller: Poller | None = None
        try:
            loop.add_reader(self.epoll.fileno(), self._fire)
        except BaseException:
            self.epoll.close()
            raise

    def _fire(self) -> None:
        if self.poller is not None:
            self.poller._wake()

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.remove_reader(self.epoll.fileno())
        self.epoll.close()


class PollerPool:
    """Epoll instances kept registered with their event loop between the
    pollers of execs: registering one and dropping it again costs more than
    the rest of what the host does for a short exec. One pool serves every
    sandbox of the process, so that an idle sandbox holds none."""

    KEEP = 16  # per loop, the pool grows to the busiest moment's concurrency, up to this

    def __init__(self) -> None:
        # Per loop; a closed loop's are closed when the next loop comes.
        self._free: dict[asyncio.AbstractEventLoop, list[_LoopEpoll]] = {}

    def _take(self, loop: asyncio.AbstractEventLoop) -> _LoopEpoll:
        free = self._free.get(loop)
        if free:
            return free.pop()
        return _LoopEpoll(loop)

    def _give(self, entry: _LoopEpoll) -> None:
        loop = entry.loop
        if loop.is_closed():
            entry.close()
            return
        free = self._free.get(loop)
        if free is None:
            free = self._free[loop] = []
            self._sweep_closed()
        if len(free) < self.KEEP:
            free.append(entry)
        else:
            entry.close()

    def _sweep_closed(self) -> None:
        """Closes what is kept for loops that have closed since (each
        thread's loop adds its own entry: the keys are copied first)."""
        for loop in [loop for loop in list(self._free) if loop.is_closed()]:
            for entry in self._free.pop(loop, []):
                entry.close()

    def close(self) -> None:
        for loop in list(self._free):
            for entry in self._free.pop(loop, []):
                entry.close()


class Poller:
    """Level-triggered readiness for a changing set of descriptors.

    POLLHUP and POLLERR count as ready (the read or write then says what
    happened). A descriptor is forgotten before it is closed (closing it
    would not take it out of the epoll while another process holds a copy,
    a child forked meanwhile, say). close() must be called once the poller
    is done, while the descriptors it still watches are open.
    """

    def __init__(self, pool: PollerPool | None = None) -> None:
        self._events: dict[int, int] = {}
        self._waiter: asyncio.Future[bool] | None = None
        self._pool = pool
        self._entry: _LoopEpoll | None = None
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (trio): wait() asks anyio instead
            self._loop = None
        if self._loop is None:
            self._epoll = select.epoll()
            return
        self._entry = pool._take(self._loop) if pool is not None else _LoopEpoll(self._loop)
        self._entry.poller = self
        self._epoll = self._entry.epoll

    def watch(self, fd: int, read: bool = False, write: bool = False) -> None:
        """Sets what to wait for on `fd`; neither forgets it (which must
        happen before it is closed)."""
        events = (select.EPOLLIN if read else 0) | (select.EPOLLOUT if write else 0)
        old = self._events.get(fd)
        if old == events or (old is None and not events):
            return
        if old is None:
            try:
                self._epoll.register(fd, events)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise _watches_used_up() from None
                raise
        elif events:
            self._epoll.modify(fd, events)
        else:
            self._epoll.unregister(fd)
        if events:
            self._events[fd] = events
        else:
            del self._events[fd]

    def want_read(self, fd: int) -> None:
        self.watch(fd, read=True, write=bool(self._events.get(fd, 0) & select.EPOLLOUT))

    def want_write(self, fd: int) -> None:
        self.watch(fd, read=bool(self._events.get(fd, 0) & select.EPOLLIN), write=True)

    def forget(self, fd: int) -> None:
        self.watch(fd)

    def close(self) -> None:
        entry, self._entry = self._entry, None
        events, self._events = self._events, {}
        if entry is None:
            self._epoll.close()
            return
        entry.poller = None
        if self._pool is None:
            entry.close()
            return
        try:
            for fd in events:
                self._epoll.unregister(fd)
        except OSError:
            entry.close()  # it may hold what could not be taken out
            return
        self._pool._give(entry)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def now(self) -> float:
        """The event loop's clock (anyio.current_time, without its lookups)."""
        return self._loop.time() if self._loop is not None else anyio.current_time()

    async def wait(self, timeout: float | None = None) -> set[int]:
        """Returns the descriptors that are ready (at least one), or an
        empty set once `timeout` seconds have passed."""
        deadline = math.inf if timeout is None else self.now() + timeout
        while True:
            ready = {fd for fd, _ in self._epoll.poll(0)}
            if ready:
                return ready
            remaining = math.inf if timeout is None else deadline - self.now()
            if remaining <= 0:
                return set()
            if not self._events:
                # Nothing to wait for: sleep until the deadline, rather than
                # return no descriptor to a caller that loops on wait().
                await anyio.sleep(remaining)
                return set()
            if self._loop is not None:
                await self._wait_asyncio(self._loop, remaining)
            else:
                with anyio.move_on_after(remaining):
                    await anyio.wait_readable(self._epoll.fileno())

    async def _wait_asyncio(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Waits for our epoll to become readable, or `timeout`. A future
        and a timer, not a cancel scope: this runs at every wakeup of every
        exec, and a scope costs more than the rest of it."""
        waiter = self._waiter = loop.create_future()
        timer = None if timeout == math.inf else loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _expire(waiter: "asyncio.Future[bool]", result: bool = False) -> None:
    if not waiter.done():
        waiter.set_result(result)


POLLERS = PollerPool()  # the process's
