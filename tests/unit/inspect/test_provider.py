"""The Inspect provider's configuration and lifecycle, without a model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from nsbox import NsboxError
from nsbox.host import dirs, idmap
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment, load_config

from tests.conftest import fixture_tar


def test_yaml_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "cfg").mkdir()
    cfg_file = tmp_path / "cfg" / "nsbox.yaml"
    cfg_file.write_text("rootfs: ../image\nmounts: ['../data:/data:ro']\nsandboxes:\n  web: {rootfs: ./w}\n")
    cfg = load_config(str(cfg_file))
    assert cfg.rootfs == str(tmp_path / "image")
    assert cfg.mounts == (f"{tmp_path / 'data'}:/data:ro",)
    assert cfg.sandboxes is not None and cfg.sandboxes["web"].rootfs == str(tmp_path / "cfg" / "w")
    # Logs store the model as a dict: it must come back the same.
    assert NsboxSandboxEnvironment.config_deserialize(cfg.model_dump()) == cfg
    assert hash(cfg) == hash(NsboxConfig(**cfg.model_dump()))


def test_invalid_configuration_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "nsbox.yaml"
    for text, field in [("network: wifi\n", "network"), ("workdir: relative\n", "workdir"),
                        ("mounts: ['nocolon']\n", "mounts"), ("usr: root\n", "usr"),
                        ("sandboxes: {x: {user: 3}}\n", "sandboxes.x.user")]:
        bad.write_text(text)
        with pytest.raises(NsboxError) as e:
            load_config(str(bad))
        assert f"  {field}" in str(e.value) and str(bad) in str(e.value), str(e.value)
    bad.write_text("- a list\n")
    with pytest.raises(NsboxError, match="expected a mapping"):
        load_config(str(bad))
    with pytest.raises(NsboxError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValidationError):
        NsboxConfig(network="wifi")  # type: ignore[arg-type]


def test_settings_are_checked_as_sandbox_specs(tmp_path: Path) -> None:
    """SandboxSpec's rules, at the field that breaks them; an entry of
    `sandboxes` is checked merged with the top-level settings."""
    bad = tmp_path / "nsbox.yaml"
    for text, where, says in [
            ("hostname: 'two words'\n", "  hostname:", "hostname must be"),
            ("hosts: {db: not-an-address}\n", "  hosts:", "not-an-address"),
            ("memory: 1k\n", "  memory:", "at least 6m"),
            ("network: container:abc\n", "  network:", "'net:NAME'"),
            ("image: alpine\nrootfs: /srv/root\n", "  (top):", "either rootfs or image"),
            ("sandboxes:\n  web: {workdir: rel}\n", "  sandboxes.web.workdir:", "absolute path"),
            ("rootfs: /srv/root\nsandboxes:\n  web: {image: alpine}\n", "  sandboxes.web:", "either rootfs or image"),
            ("workdir: rel\nsandboxes:\n  web: {}\n", "  workdir:", "absolute path")]:
        bad.write_text(text)
        with pytest.raises(NsboxError) as e:
            load_config(str(bad))
        assert where in str(e.value) and says in str(e.value), (text, str(e.value))
    # What an entry leaves out comes from the top level: allow needs the
    # proxy mode, which the top level sets.
    cfg = NsboxConfig(network="proxy", sandboxes={"web": {"allow": ["example.com"]}, "db": {"network": "none"}})
    assert [(name, s.network, s.allow) for name, s in cfg.settings()] == [
        ("web", "proxy", ("example.com",)), ("db", "none", ())]
    with pytest.raises(ValidationError, match="allow applies to the proxy network mode"):
        NsboxConfig(network="proxy", allow=["example.com"], sandboxes={"web": {"network": "none"}})


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


def test_default_concurrency_is_sane() -> None:
    # No default limit (as `local`): Inspect would delay each sample by up to 1 s.
    assert NsboxSandboxEnvironment.default_concurrency() is None
    assert NsboxSandboxEnvironment.config_files() == ["nsbox.yaml", "nsbox.yml", "compose.yaml", "compose.yml",
                                                      "docker-compose.yaml", "docker-compose.yml", "Dockerfile"]
    assert NsboxSandboxEnvironment.is_docker_compatible()
