"""nsbox/create/exhaustion.py: each errno of a limit reached, as the error
naming it (the limits themselves are reached for real in
tests/host/test_resource_exhaustion.py; these are the ones a test cannot
safely reach on a shared host: the host's file table, memory, quotas)."""

from __future__ import annotations

import errno

import pytest

from nsbox.create import exhaustion
from nsbox.create.zygote import CloneError
from nsbox.errors import HostPrerequisiteError, NsboxError, ResourceExhausted, SandboxSetupError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("err, limit, words", [
    (errno.EMFILE, "RLIMIT_NOFILE", ("too many open files", "RLIMIT_NOFILE soft", "ulimit")),
    (errno.ENFILE, "fs.file-max", ("table of open files is full", "sysctl -w fs.file-max")),
    (errno.ENOMEM, "memory", ("out of memory", "MemAvailable")),
    (errno.ENOSPC, "disk space", ("no space left on the filesystem of /tmp", "NSBOX_STATE_DIR")),
    (errno.EDQUOT, "disk quota", ("disk quota is exceeded", "NSBOX_STATE_DIR")),
])
def test_each_errno_names_its_limit(err: int, limit: str, words: tuple[str, ...]) -> None:
    e = exhaustion.translate(OSError(err, "x", "/tmp"))
    assert isinstance(e, ResourceExhausted) and isinstance(e, SandboxSetupError)
    assert e.limit == limit and e.hint
    for word in words:
        assert word in str(e)
    assert "\n" not in str(e)


def test_other_errors_are_left_alone() -> None:
    assert exhaustion.translate(OSError(errno.ENOENT, "x", "/tmp/y")) is None
    assert exhaustion.translate(ValueError("no")) is None
    assert exhaustion.translate(NsboxError("its own message")) is None
    assert exhaustion.translate(ResourceExhausted("already", limit="x")) is None


def test_an_nsbox_error_caused_by_a_limit_names_the_limit() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/tmp/state/run")
        except OSError as e:
            raise NsboxError(f"cannot create the state directory: {e.strerror}") from None
    except NsboxError as wrapped:
        e = exhaustion.translate(wrapped)
    assert isinstance(e, ResourceExhausted) and "/tmp/state/run" in str(e)


def test_a_failed_clone_is_not_a_full_disk() -> None:
    e = exhaustion.translate(CloneError(errno.EAGAIN, "Resource temporarily unavailable"))
    assert isinstance(e, ResourceExhausted) and "no space" not in str(e)
    # A clone refused for another reason keeps hostcheck's diagnosis.
    assert isinstance(exhaustion.translate(CloneError(errno.EINVAL, "Invalid argument")), HostPrerequisiteError)


def test_descriptors_placed_beyond_the_limit_are_the_descriptor_limit() -> None:
    e = exhaustion.of_setup(errno.EINVAL, clones=False, places_fds=True, path="/tmp")
    assert isinstance(e, ResourceExhausted) and e.limit == "RLIMIT_NOFILE"
    assert exhaustion.of_setup(errno.EINVAL, clones=False, places_fds=False, path="/tmp") is None


def test_nproc_is_blamed_only_when_reached() -> None:
    """EAGAIN with a finite RLIMIT_NPROC far above what this user runs is
    not "your limit of processes is reached" (it had been, uncounted), in a
    process that is not exempt from the limit."""
    import subprocess
    import sys

    code = ("import errno, os, resource\n"
            "from nsbox.create import exhaustion\n"
            "hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]\n"
            "soft = 60000 if hard == resource.RLIM_INFINITY else min(hard, 60000)\n"
            "resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard if os.geteuid() else soft))\n"
            "if os.geteuid() == 0:  # root is exempt: nobody is not\n"
            "    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)\n"
            "print(exhaustion.translate(BlockingIOError(errno.EAGAIN, 'x')))\n"
            "print(exhaustion.of_clone(errno.EAGAIN).limit)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "processes"]


def test_enospc_from_a_mount_is_the_limit_of_mounts() -> None:
    """ENOSPC from a step that mounts is fs.mount-max (mount(2) needs no
    disk space); from a step that writes the layer, a full disk."""
    e = exhaustion.of_setup(errno.ENOSPC, clones=False, places_fds=False, path="/tmp/layer", mounts=True)
    assert e is not None and e.limit == "fs.mount-max" and "sysctl -w fs.mount-max" in str(e)
    e = exhaustion.of_setup(errno.ENOSPC, clones=False, places_fds=False, path="/tmp/layer")
    assert e is not None and e.limit == "disk space"
