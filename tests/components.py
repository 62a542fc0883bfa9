"""What the tests need beyond `pip install '.[inspect,test]'`, in one place.

Each component says how to tell it is here and the one command that brings
it. A test that needs one says so, and is skipped (with that command) where
the component is absent, or fails where CI is set (CI=true), so that CI
still proves everything:

    @pytest.mark.needs("skopeo", "umoci")      # a test, a class or pytestmark
    def test_x(): ...

    components.require("tun")                  # inside a test or fixture

The fixtures `busybox_rootfs`, `debian_rootfs` and `fixture_tar()` require
their fixture tarball themselves. Only a component that is truly absent
skips a test: a component that is here but misbehaves fails it.
NSBOX_TEST_PRETEND_MISSING=busybox,skopeo (or "all") treats components as
absent, to see what a machine without them runs.

The core contract (exec, files, truncation, timeouts, users, cleanup,
escapes) needs none of these: it runs on the built-in default root
filesystem.

`python3 tests/components.py packages` prints the Debian packages of the
components whose packages are not installed (tests/run.sh as root installs
them); `table` prints every component's state; `report FILE...` merges the
counts each pytest run wrote to $NSBOX_TEST_COMPONENTS_REPORT into the
table tests/run.sh ends with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FIXTURES = Path(os.environ.get("NSBOX_TEST_FIXTURES") or Path(__file__).resolve().parent.parent / "rootfs" / "build")


def which(name: str) -> str | None:
    """`name` on PATH, or in the sbin directories a test user's PATH lacks."""
    return shutil.which(name) or shutil.which(name, path=SBIN_PATH)


def _tools(*names: str) -> Callable[[], bool]:
    return lambda: all(which(n) for n in names)


def _device(path: str) -> Callable[[], bool]:
    def usable() -> bool:
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            return True
        except OSError:
            return False
    return usable


def _fixture(name: str) -> Callable[[], bool]:
    return lambda: (FIXTURES / f"{name}.tar").is_file()


def _slurm() -> bool:
    """A node of a SLURM cluster answers; as root, tests/slurm/setup.sh can
    start one when SLURM is installed (tests/host/test_slurm.py runs it)."""
    if os.geteuid() == 0:
        return all(which(n) for n in ("slurmctld", "slurmd", "munged", "sbatch"))
    if not which("sinfo"):
        return False
    try:
        r = subprocess.run([which("sinfo") or "sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                           timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and any(s in ("idle", "mixed", "allocated", "completing") for s in r.stdout.split())


@dataclass(frozen=True)
class Component:
    name: str
    what: str
    present: Callable[[], bool]
    fix: str                      # the one command that brings it
    packages: tuple[str, ...] = ()  # Debian packages root may install for it


APT = "sudo apt-get install"
COMPONENTS = {c.name: c for c in [
    Component("busybox", "the BusyBox fixture rootfs, rootfs/build/busybox.tar", _fixture("busybox"),
              f"{APT} busybox-static  # then make test builds it", ("busybox-static",)),
    Component("debian", "the Debian fixture rootfs, rootfs/build/debian.tar, made by mmdebstrap",
              _fixture("debian"), f"{APT} mmdebstrap uidmap  # then make test builds it",
              ("mmdebstrap", "debian-archive-keyring", "uidmap")),
    Component("docker-registry", "an OCI registry on 127.0.0.1", _tools("docker-registry"),
              f"{APT} docker-registry", ("docker-registry",)),
    Component("skopeo", "image copies", _tools("skopeo"), f"{APT} skopeo", ("skopeo",)),
    Component("umoci", "image builds", _tools("umoci"), f"{APT} umoci", ("umoci",)),
    Component("openssl", "the registry's TLS and token keys", _tools("openssl"), f"{APT} openssl", ("openssl",)),
    Component("zstd", "zstd-compressed layers", _tools("zstd"), f"{APT} zstd", ("zstd",)),
    Component("iproute2", "`ip`, in the network tests' stand-in sandboxes", _tools("ip"), f"{APT} iproute2",
              ("iproute2",)),
    Component("pasta", "the nat network mode's pasta", _tools("pasta"), f"{APT} passt", ("passt",)),
    Component("slirp4netns", "the nat network mode's slirp4netns", _tools("slirp4netns"), f"{APT} slirp4netns",
              ("slirp4netns",)),
    Component("usernet", "pasta or slirp4netns: the nat network mode", lambda: bool(which("pasta") or which("slirp4netns")),
              f"{APT} passt", ("passt",)),
    Component("tun", "/dev/net/tun usable by this user, for the nat network mode", _device("/dev/net/tun"),
              "sudo chmod 0666 /dev/net/tun"),
    Component("fuse", "/dev/fuse usable by this user, for a hung file system", _device("/dev/fuse"),
              "sudo chmod 0666 /dev/fuse"),
    Component("seccomp", "scmp_sys_resolver: libseccomp's syscall tables", _tools("scmp_sys_resolver"),
              f"{APT} seccomp", ("seccomp",)),
    Component("aarch64", "an aarch64 cross compiler and qemu-user", _tools("aarch64-linux-gnu-gcc", "qemu-aarch64"),
              f"{APT} gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user",
              ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user")),
    Component("slurm", "a SLURM cluster: installed as root, running otherwise", _slurm,
              f"{APT} slurm-wlm munge && sudo tests/slurm/setup.sh", ("slurm-wlm", "munge")),
]}

_cache: dict[str, bool] = {}
SKIP_PREFIX = "needs component "


def pretended() -> set[str]:
    names = {n.strip() for n in os.environ.get("NSBOX_TEST_PRETEND_MISSING", "").split(",") if n.strip()}
    return set(COMPONENTS) if "all" in names else names


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def here(name: str) -> bool:
    if name not in COMPONENTS:
        raise KeyError(f"unknown test component {name!r}; known: {', '.join(COMPONENTS)}")
    if name in pretended():
        return False
    if name not in _cache:
        _cache[name] = COMPONENTS[name].present()
    return _cache[name]


def usable(*names: str) -> bool:
    """For a test that does less without them: whether they are all here.
    Under CI their absence fails the test."""
    if all(here(n) for n in names):
        return True
    if in_ci():
        require(*names)
    return False


def forget(name: str) -> None:
    """Checks `name` again next time (after something built it)."""
    _cache.pop(name, None)


def require(*names: str) -> None:
    """Skips the calling test when a component is absent; fails it under CI."""
    import pytest

    for name in names:
        if here(name):
            continue
        c = COMPONENTS[name]
        if in_ci():
            pytest.fail(f"component {name} ({c.what}) is missing, and CI runs everything: {c.fix}")
        pytest.skip(f"{SKIP_PREFIX}{name} ({c.what}): {c.fix}")


def skipped_by(reasons: list[str]) -> Counter[str]:
    """Tests skipped per component, from the skip reasons of a run (a
    session fixture skips each of its tests without asking again)."""
    counts: Counter[str] = Counter()
    for reason in reasons:
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(SKIP_PREFIX):
            counts[reason[len(SKIP_PREFIX):].split(" ", 1)[0]] += 1
    return counts


def table(counts: Counter[str]) -> list[str]:
    """The summary: each component that skipped tests, and its command."""
    width = max(len(n) for n in counts)
    return [f"  {n:<{width}}  {counts[n]:>4} test{'s' if counts[n] > 1 else ' '}  {COMPONENTS[n].fix}"
            for n in sorted(counts)]


def report(files: list[str]) -> list[str]:
    """The merged table of several runs' reports (a run without one wrote none)."""
    counts: Counter[str] = Counter()
    for f in files:
        try:
            counts.update(json.loads(Path(f).read_text()))
        except FileNotFoundError:
            continue
    if not counts:
        return ["  none: every component the tests need is here"]
    return table(counts)


def missing_packages() -> list[str]:
    """Debian packages of absent components that are not installed."""
    out: list[str] = []
    for c in COMPONENTS.values():
        if here(c.name):
            continue
        for p in c.packages:
            r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
            if "install ok installed" not in r.stdout and p not in out:
                out.append(p)
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "table"
    if what == "packages":
        print(" ".join(missing_packages()))
    elif what == "report":
        print("\n".join(report(sys.argv[2:])))
    elif what == "table":
        for c in COMPONENTS.values():
            print(f"  {c.name:<16} {'here' if here(c.name) else 'ABSENT':<7} {c.what}")
    else:
        sys.exit(f"usage: {sys.argv[0]} [table|packages|report FILE...]")
