"""The Inspect provider's configuration and lifecycle, without a model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from nsbox import NsboxError
from nsbox.errors import SandboxSetupError
from nsbox.spec import Bind
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment, load_config


def test_yaml_paths_are_relative_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSBOX_COMPOSE_PATHS", str(tmp_path))  # ../ is outside the file's directory
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


def test_a_dumped_config_reads_back_as_the_same_sandboxes() -> None:
    """An entry states only what it overrides: read back from a dump (an
    eval log's), its defaults must not override the top level."""
    cfg = NsboxConfig(rootfs="/opt/r", network="nat", sandboxes={"default": {}, "b": {"user": "nobody"}})
    for dump in (cfg.model_dump(), cfg.model_dump(mode="json")):
        back = NsboxSandboxEnvironment.config_deserialize(dump)
        assert isinstance(back, NsboxConfig)
        assert back.settings() == cfg.settings()
        assert [(n, s.rootfs, s.network, s.user) for n, s in back.settings()] == [
            ("default", "/opt/r", "nat", None), ("b", "/opt/r", "nat", "nobody")]
    # Equal only when the sandboxes are: an entry that sets a default is not one that leaves it.
    assert NsboxConfig(network="nat", sandboxes={"a": {}}) != NsboxConfig(network="nat", sandboxes={"a": {"network": "none"}})


@pytest.mark.parametrize("text, message", [
    ("mounts: ['/root:/r:ro']\n", "mounts: source /root is outside the project directory"),
    ("mounts: ['../data:/d']\n", "mounts: source .*/data is outside the project directory"),
    ("rootfs: /\n", "rootfs / is outside the project directory"),
    ("sandboxes: {web: {mounts: ['out:/l']}}\n", "sandboxes.web.mounts: source .*/data is outside"),
    ("network: host\n", "network: host reaches every service on the host's loopback"),
    ("sandboxes: {web: {network: host}}\n", "sandboxes.web.network: host"),
    ("id_mapping: host-root\n", "id_mapping: host-root makes sandbox root host root"),
])
def test_a_file_is_held_to_an_eval_suites_rights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                                 message: str) -> None:
    """An nsbox.yaml is an eval suite's, as a compose file is (a sample may
    name one of its own): it had bound any host path, and asked for the
    host's network and host root. Host paths must lie in its directory
    (or NSBOX_COMPOSE_PATHS); the host's network and root are the operator's."""
    monkeypatch.delenv("NSBOX_COMPOSE_PATHS", raising=False)
    monkeypatch.delenv("NSBOX_COMPOSE_HOST_NETWORK", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "out").symlink_to(tmp_path / "data")  # a symlink leading out
    (tmp_path / "cfg" / "inner").mkdir()
    (tmp_path / "cfg" / "link").symlink_to("inner")
    cfg_file = tmp_path / "cfg" / "nsbox.yaml"
    cfg_file.write_text(text)
    with pytest.raises(NsboxError, match=message):
        load_config(str(cfg_file))
    if "network: host" in text:  # the operator grants it
        monkeypatch.setenv("NSBOX_COMPOSE_HOST_NETWORK", "1")
        assert load_config(str(cfg_file)) is not None
    # What stays inside is fine, and Python code is the task's own.
    cfg_file.write_text("mounts: ['./link/../link:/l', '.:/cfg']\nrootfs: ./rootfs\n")
    (tmp_path / "cfg" / "rootfs").mkdir()
    load_config(str(cfg_file))
    assert load_config(NsboxConfig(mounts=("/root:/r",), id_mapping="host-root")).mounts == ("/root:/r",)


def test_a_mount_a_sandbox_turned_into_a_symlink_is_not_resolved_again(tmp_path: Path) -> None:
    """The configuration is read once, its sources resolved and checked
    then; every sample's sandbox is made from it. One sample's sandbox, given
    ./data writable, swaps data/sub for a symlink to /: the next sample had
    resolved the source again, and bound the host's /."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    cfg_file = tmp_path / "nsbox.yaml"
    cfg_file.write_text("mounts: ['./data:/data', './data/sub:/sub']\n")
    cfg = load_config(str(cfg_file))
    assert [b.source for b in cfg.spec().mounts] == [str(tmp_path / "data"), str(tmp_path / "data" / "sub")]
    (tmp_path / "data" / "sub").rmdir()  # what the first sample's sandbox does through /data
    (tmp_path / "data" / "sub").symlink_to("/")
    with pytest.raises(SandboxSetupError, match="now leads to /: a symlink was put in it since it was checked"):
        cfg.spec()
    with pytest.raises(SandboxSetupError, match="now leads to /"):
        Bind.exact(str(tmp_path / "data" / "sub"), "/sub")  # compose's binds are made so too
    assert Bind(str(tmp_path / "data" / "sub"), "/sub").source == "/"  # the API's: resolved, as Docker does


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


def test_default_concurrency_is_sane() -> None:
    # No default limit (as `local`): Inspect would delay each sample by up to 1 s.
    assert NsboxSandboxEnvironment.default_concurrency() is None
    assert NsboxSandboxEnvironment.config_files() == ["nsbox.yaml", "nsbox.yml", "compose.yaml", "compose.yml",
                                                      "docker-compose.yaml", "docker-compose.yml", "Dockerfile"]
    assert NsboxSandboxEnvironment.is_docker_compatible()
