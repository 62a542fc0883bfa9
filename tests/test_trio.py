"""The async tests of exec, capture, files and lifecycle, run again on trio.

nsbox runs on any anyio backend, but its hot paths have an asyncio fast
path (nsbox/fdwait.Poller registers loop callbacks) and a generic one built
on anyio.wait_readable / wait_writable, which only trio takes. The rest of
the suite runs on asyncio alone; this module collects the coroutine tests
of the modules below a second time, under their own names, with the
`anyio_backend` fixture overridden to trio. That exercises the generic
Poller (streams, stdin, timeouts, cancellation, 200 concurrent execs), file
transfer, and sandbox creation and teardown on trio, for a few seconds.

Synchronous tests of those modules (subprocess scenarios, pure unit tests)
do not depend on the backend and are not repeated. Add a module to
TRIO_TOO to cover it as well.
"""

from __future__ import annotations

import inspect
import os

import anyio
import pytest
import trio

from nsbox.fdwait import Poller

from . import test_capture, test_exec, test_files, test_lifecycle
from .test_files import host_secret  # noqa: F401  (a fixture of test_files' tests)

TRIO_TOO = (test_exec, test_capture, test_files, test_lifecycle)


def _collect() -> list[str]:
    names = []
    for module in TRIO_TOO:
        for name, obj in vars(module).items():
            if name.startswith("test_") and inspect.iscoroutinefunction(obj):
                assert name not in globals(), f"{name} is defined twice among {TRIO_TOO}"
                globals()[name] = obj
                names.append(name)
    return names


COLLECTED = _collect()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "trio"


async def test_these_run_on_trio_and_the_generic_poller() -> None:
    assert len(COLLECTED) > 30
    trio.lowlevel.current_task()  # raises RuntimeError outside trio
    assert Poller()._loop is None  # the generic path, not the asyncio callbacks


async def test_generic_poller_reports_each_ready_descriptor() -> None:
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
        poller.close()
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)
