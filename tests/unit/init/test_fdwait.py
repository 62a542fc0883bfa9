"""nsbox.init.fdwait.Poller, the readiness wait of every exec, on both of its paths:
asyncio's (its epoll registered with the loop, a future and a loop timer)
and the generic one trio takes (anyio.wait_readable and cancel scopes)."""

from __future__ import annotations

import os

import anyio
import pytest

from nsbox.init.fdwait import Poller, PollerPool


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_poller_reports_each_ready_descriptor() -> None:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        poller = Poller()
        poller.want_read(r1)
        poller.want_read(r2)
        poller.want_write(w2)
        assert await poller.wait() == {w2}  # nothing to read yet; the pipe has room
        poller.forget(w2)
        os.write(w1, b"x")
        with anyio.fail_after(5):
            assert await poller.wait() == {r1}
        os.write(w2, b"y")
        with anyio.fail_after(5):
            ready = await poller.wait()
        assert r2 in ready and ready <= {r1, r2}  # level-triggered: r1 is still readable
        with anyio.move_on_after(0.1) as scope:  # cancellable while it waits
            poller.forget(r1)
            poller.forget(r2)
            os.read(r2, 1)
            poller.want_read(r2)
            await poller.wait()
        assert scope.cancelled_caught
        poller.forget(r2)
        with anyio.move_on_after(0.1) as scope:  # nothing watched: it blocks, as on asyncio
            await poller.wait()
        assert scope.cancelled_caught
        poller.want_read(r2)  # empty again: a timeout ends the wait with nothing ready
        started = anyio.current_time()
        assert await poller.wait(0.05) == set()
        assert anyio.current_time() - started >= 0.05
        poller.close()
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


async def test_a_pool_keeps_epolls_registered_between_pollers(anyio_backend: str) -> None:
    pool = PollerPool()
    r, w = os.pipe()
    try:
        first = Poller(pool)
        first.want_read(r)
        first_epoll = first._epoll
        first.close()
        second = Poller(pool)
        if anyio_backend == "asyncio":
            assert second._epoll is first_epoll  # reused, still registered with the loop
        else:
            assert not pool._free  # trio: nothing to keep registered
        assert await second.wait(0.05) == set()  # what the first watched is gone
        second.want_read(r)
        os.write(w, b"x")
        with anyio.fail_after(5):
            assert await second.wait() == {r}
        second.close()
        pool.close()
        assert second._epoll.closed and not pool._free
    finally:
        os.close(r)
        os.close(w)


def test_a_pool_drops_what_an_earlier_event_loop_registered() -> None:
    pool = PollerPool()

    async def use() -> None:
        Poller(pool).close()

    anyio.run(use)
    ((first_loop, (kept,)),) = pool._free.items()
    anyio.run(use)  # a new loop: the first one's epoll cannot serve it
    assert kept.epoll.closed
    ((loop, (entry,)),) = pool._free.items()
    assert loop is not first_loop and entry is not kept
    pool.close()


async def test_a_full_epoll_quota_is_named_not_a_bare_enospc() -> None:
    """epoll_ctl fails with ENOSPC once the user's fs.epoll.max_user_watches
    are taken, which a sandbox's processes can do (they count as this user):
    the next exec had raised a bare OSError, and creation blamed a full
    disk. (The kernel's refusal is stood in for: reaching the real quota
    would take it from every process of the user running the tests.)"""
    import errno

    from nsbox.errors import ResourceExhausted

    class FullEpoll:
        def register(self, fd: int, events: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    r, w = os.pipe()
    poller = Poller()
    real, poller._epoll = poller._epoll, FullEpoll()  # type: ignore[assignment]
    try:
        with pytest.raises(ResourceExhausted, match="this user's epoll watches are used up") as e:
            poller.want_read(r)
        assert e.value.limit == "fs.epoll.max_user_watches" and "sysctl" in (e.value.hint or "")
    finally:
        poller._epoll = real
        poller.close()
        os.close(r)
        os.close(w)
