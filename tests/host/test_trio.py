"""The async tests of exec, capture, files and lifecycle, run again on trio.

nsbox runs on any anyio backend, but its hot paths have an asyncio fast
path (nsbox/fdwait.Poller registers its epoll with the loop, and waits on a
future and a loop timer) and a generic one built on anyio.wait_readable and
cancel scopes, which only trio takes. The rest of
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

import pytest
import trio

from nsbox.init.fdwait import Poller

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
    poller = Poller()
    try:
        assert poller._loop is None  # the generic path, not the asyncio callbacks
    finally:
        poller.close()
