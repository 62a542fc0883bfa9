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
