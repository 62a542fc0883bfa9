"""Shared fixtures.

Every test runs in the identity mode of the user running pytest (root,
subuid or single; see nsbox/host/idmap.py). tests/run.sh runs the suite once per
mode with a real user of each kind, and sets NSBOX_TEST_EXPECT_MODE so that
a machine missing a prerequisite fails loudly instead of silently testing
another mode.

What a test needs beyond the Python packages (a fixture rootfs, skopeo,
/dev/net/tun, ...) is declared with @pytest.mark.needs("name", ...) or
components.require("name"); see tests/components.py for the names, and for
what happens where a component is absent (a skip naming the command that
installs it; a failure under CI=true). The run ends with a table of the
components it did without.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import pytest

import nsbox
from nsbox.host import dirs, idmap, removal
from nsbox.sandbox import confined
from nsbox.storage.tarball import import_tarball
from nsbox.create.unshare import remove_layer

from . import components
from .components import FIXTURES

MODE = idmap.detect()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"nsbox identity mode: {MODE.mode} (uid {os.getuid()}) - {MODE.reason}",
            f"nsbox fixture tarballs: {FIXTURES}"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(*components): skipped where a component of tests/components.py "
                                       "is absent (failed under CI=true)")
    config.addinivalue_line("markers", "once: no identity mode can change its outcome (it makes no sandbox, or "
                                       "what it tests runs the same in every mode: the init once set up, the "
                                       "host's collection of leftovers, its waits for healthchecks, its "
                                       "connections shared by threads): "
                                       "tests/run.sh runs it in the root pass only, as tests/unit")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        components.require(*mark.args)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reasons = [r.longrepr[2] for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and len(r.longrepr) == 3]
    counts = components.skipped_by(reasons)
    out = os.environ.get("NSBOX_TEST_COMPONENTS_REPORT")
    if out:  # tests/run.sh merges these into the table it ends with
        Path(out).write_text(json.dumps(counts))
    if counts:
        terminalreporter.section("components this run did without: their tests were skipped")
        for line in components.table(counts):
            terminalreporter.write_line(line)


def pytest_sessionstart(session: pytest.Session) -> None:
    expected = os.environ.get("NSBOX_TEST_EXPECT_MODE")
    if expected and expected != MODE.mode:
        pytest.exit(f"expected identity mode {expected!r} but this user gets {MODE.mode!r}: {MODE.reason}",
                    returncode=3)


@pytest.fixture(autouse=True)
def _released_layers() -> None:
    """Each test starts once the layers of the sandboxes closed before it
    are released (removal's sweeper thread), so that what it finds on disk
    is its own doing."""
    assert removal.wait_swept(60), "the sweeper did not finish the previous test's releases"


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def mode() -> str:
    """The identity mode this run exercises: "root", "subuid" or "single"."""
    return MODE.mode


def process_named(init: int, name: str) -> Any:
    """A descendant of process `init` (a sandbox's init, say) running
    `name`: a command started in the background may still be execing when
    the exec that started it returns."""
    import time

    import psutil

    deadline = time.monotonic() + 10
    while True:
        found = [p for p in psutil.Process(init).children(recursive=True) if p.name() == name]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {name} under process {init}"
        time.sleep(0.02)


def script_result(code: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> Any:
    """Runs `code` in a fresh interpreter (a limit, a fork or a thread of
    its own) and returns the JSON it printed after "RESULT " last; fails
    the test, with stderr's end, if it exited otherwise or printed none."""
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def fixture_tar(name: str) -> Path:
    """The fixture tarball `name` ("busybox" or "debian"); a test that asks
    for it is skipped where it could not be built (components.py)."""
    components.require(name)
    return components.FIXTURES / f"{name}.tar"


def _imported_rootfs(name: str) -> Path:
    """The fixture tarball `name` unpacked for this user (cached)."""
    tar = fixture_tar(name)
    st = tar.stat()
    cache = dirs.cache_dir() / "test-rootfs"
    cache.mkdir(exist_ok=True)
    # Keyed by the tarball's path too: runs from other checkouts, as the same
    # user at the same time, keep their copies instead of removing each other's.
    where = hashlib.sha256(str(tar.resolve()).encode()).hexdigest()[:8]
    dest = cache / f"{name}-{where}-{st.st_size}-{st.st_mtime_ns}-{MODE.key}"
    if not dest.exists():
        for old in cache.glob(f"{name}-{where}-*"):
            remove_layer(old, MODE)
        anyio.run(functools.partial(import_tarball, runner=confined), tar, dest)
    return dest


@pytest.fixture(scope="session")
def debian_rootfs() -> Path:
    return _imported_rootfs("debian")


@pytest.fixture(scope="session")
def busybox_rootfs() -> Path:
    return _imported_rootfs("busybox")


@pytest.fixture
async def sandbox() -> AsyncIterator[nsbox.Sandbox]:
    """A sandbox on the built-in host-composed root."""
    async with nsbox.Sandbox() as sb:
        yield sb


@pytest.fixture
async def debian(debian_rootfs: Path) -> AsyncIterator[nsbox.Sandbox]:
    async with nsbox.Sandbox(debian_rootfs) as sb:
        yield sb
