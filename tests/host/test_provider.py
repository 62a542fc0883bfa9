"""The Inspect provider's lifecycle on real sandboxes, without a model."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest

import nsbox.sandbox
from nsbox.host import dirs, idmap, live, removal
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment

from tests.conftest import fixture_tar


async def test_hostname_and_hosts_from_nsbox_yaml(tmp_path: Path) -> None:
    config = tmp_path / "nsbox.yaml"
    config.write_text("hostname: lab-box\nhosts: {db.example: 10.1.2.3, cache: '::1'}\n"
                      "sandboxes:\n  default: {}\n  other: {hostname: other-box, hosts: {}}\n")
    envs = await NsboxSandboxEnvironment.sample_init("names", str(config), {"__sample_id__": "1"})
    try:
        r = await envs["default"].exec(["hostname"])
        assert r.stdout == "lab-box\n", r
        hosts = [line.split() for line in (await envs["default"].read_file("/etc/hosts")).splitlines()]
        assert ["10.1.2.3", "db.example"] in hosts and ["::1", "cache"] in hosts, hosts
        r = await envs["other"].exec(["hostname"])
        assert r.stdout == "other-box\n", r
        assert "db.example" not in await envs["other"].read_file("/etc/hosts")
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("names", str(config), envs, False)


async def test_tarball_rootfs_and_named_sandboxes(tmp_path: Path) -> None:
    tarball = fixture_tar("busybox")
    cfg = NsboxConfig(rootfs=str(tarball), sandboxes={"default": {}, "second": {"rootfs": "host", "user": "root"}})
    await NsboxSandboxEnvironment.task_init("startup", cfg)
    envs = await NsboxSandboxEnvironment.sample_init("provider", cfg, {"__sample_id__": "7"})
    try:
        assert list(envs) == ["default", "second"]  # the default one first
        busybox = await envs["default"].exec(["sh", "-c", "readlink /bin/sh"])
        assert busybox.stdout.strip().endswith("busybox")
        host = await envs["second"].exec(["python3", "-c", "print(1)"])
        assert host.stdout == "1\n"
        # The two are separate sandboxes.
        await envs["default"].write_file("/tmp/only-here", "x")
        assert not (await envs["second"].exec(["test", "-e", "/tmp/only-here"])).success
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("provider", cfg, envs, False)
        await NsboxSandboxEnvironment.task_cleanup("shutdown", cfg, True)
    # The tarball was unpacked once, under its content hash and id mapping,
    # and a later task reuses it.
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()[:24]
    image = dirs.data_dir() / "images" / f"{digest}-{idmap.detect().key}"
    assert (image / "bin" / "busybox").is_file()
    stamp = image.stat().st_mtime_ns
    NsboxSandboxEnvironment._rootfs.clear()
    await NsboxSandboxEnvironment.task_init("startup", cfg)
    assert image.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("given", ["object", "touched file", "edited file"])
async def test_task_cleanup_finds_the_sandboxes_of_its_samples(tmp_path: Path, given: str) -> None:
    """task_cleanup(cleanup=False), as `--no-sandbox-cleanup`, detaches what
    the task's samples left, given the configuration as an object or as a
    file touched or edited during the task (the sandboxes were listed
    under the settings read from the file: once the file said something
    else, nothing was detached, and a sample's cleanup left its sandboxes
    listed for the life of the process)."""
    path = tmp_path / "nsbox.yaml"
    path.write_text("network: none\n")
    config: NsboxConfig | str = NsboxConfig(network="none") if given == "object" else str(path)
    envs = await NsboxSandboxEnvironment.sample_init("kept", config, {"__sample_id__": "1"})
    sb = envs["default"].sandbox
    try:
        if given == "touched file":
            os.utime(path, ns=(1, 1))  # the file changed as far as the cache knows; the same settings
        elif given == "edited file":
            other = await NsboxSandboxEnvironment.sample_init("kept", config, {"__sample_id__": "2"})
            path.write_text("network: none\nhostname: edited\n")
            await NsboxSandboxEnvironment.sample_cleanup("kept", config, other, False)
            assert not any(e in live for live in NsboxSandboxEnvironment._live.values() for e in other.values())
        await NsboxSandboxEnvironment.task_cleanup("kept", config, cleanup=False)
        assert sb._detached and sb.running
        assert not any(sb is env.sandbox for live in NsboxSandboxEnvironment._live.values() for env in live)
    finally:
        await sb.close()


async def test_sample_cleanup_does_not_wait_for_the_kernel_to_end_a_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample_cleanup returns once each sandbox's init is told to end: the
    next sample need not wait for the kernel to tear the last one's
    namespaces down. The sweeper thread finishes the end (an init that
    does not end, here stopped from the host, is killed after CLOSE_WAIT s),
    and then nothing of the sample is left."""
    monkeypatch.setattr(nsbox.sandbox, "CLOSE_WAIT", 0.3)  # (2 s) the stopped init's wait, shorter
    envs = await NsboxSandboxEnvironment.sample_init("ends", None, {"__sample_id__": "1"})
    sb = envs["default"].sandbox
    assert (await envs["default"].exec(["true"])).success
    pid, entry = sb.pid, live.sandbox_dir(sb.id)
    os.kill(pid, signal.SIGSTOP)
    await NsboxSandboxEnvironment.sample_cleanup("ends", None, envs, False)
    assert os.path.exists(f"/proc/{pid}"), "sample_cleanup waited for the init"
    assert removal.wait_swept(30), "the sweeper did not finish"
    assert not os.path.exists(f"/proc/{pid}") and not entry.exists()
