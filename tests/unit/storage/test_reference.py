"""Image references, platforms, credentials and config: no sandbox, no network."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from nsbox.host import idmap
from nsbox.errors import NsboxError
from nsbox.storage import oci, registry
from nsbox.storage.config import ImageConfig
from nsbox.storage.reference import ReferenceError, is_loopback, parse

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text, want", [
    ("python:3.12", "docker.io/library/python:3.12"),
    ("python", "docker.io/library/python:latest"),
    ("user/app", "docker.io/user/app:latest"),
    ("index.docker.io/library/busybox:1", "docker.io/library/busybox:1"),
    ("docker.io/busybox", "docker.io/library/busybox:latest"),
    ("ghcr.io/o/r/deep:v1.2-rc", "ghcr.io/o/r/deep:v1.2-rc"),
    ("localhost/x", "localhost/x:latest"),
    ("127.0.0.1:5000/a/b:t", "127.0.0.1:5000/a/b:t"),
    ("[::1]:5000/a", "[::1]:5000/a:latest"),
    (f"python@{DIGEST}", f"docker.io/library/python@{DIGEST}"),
    (f"python:3.12@{DIGEST}", f"docker.io/library/python:3.12@{DIGEST}"),
])
def test_normalise(text: str, want: str) -> None:
    assert str(parse(text)) == want


def test_reference_parts() -> None:
    r = parse(f"localhost:5000/team/app@{DIGEST}")
    assert (r.registry, r.repository, r.tag, r.digest, r.reference) == ("localhost:5000", "team/app", None, DIGEST, DIGEST)
    assert parse("python:3.12").short() == "python:3.12"


@pytest.mark.parametrize("bad", ["", "Python", "a//b", "python:", "python@sha256:12", "-x", "a:b:c", " python"])
def test_invalid(bad: str) -> None:
    with pytest.raises(ReferenceError):
        parse(bad)


def test_loopback() -> None:
    assert all(map(is_loopback, ["localhost", "localhost:5000", "127.0.0.1:80", "127.3.4.5", "[::1]:5000", "::1"]))
    assert not any(map(is_loopback, ["docker.io", "10.0.0.1:5000", "128.0.0.1", "localhost.example.com"]))


def test_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.MIRROR_ENV, raising=False)
    assert registry.endpoints("127.0.0.1:5000") == [registry.Endpoint("http://127.0.0.1:5000", False)]
    assert registry.endpoints("ghcr.io") == [registry.Endpoint("https://ghcr.io", True)]
    assert registry.endpoints("docker.io") == [registry.Endpoint("https://registry-1.docker.io", True)]
    monkeypatch.setenv(registry.INSECURE_ENV, "my.reg:5000")
    assert registry.endpoints("my.reg:5000")[0] == registry.Endpoint("https://my.reg:5000", False)
    monkeypatch.setenv(registry.MIRROR_ENV, "https://mirror.example/prefix")
    assert [e.base for e in registry.endpoints("docker.io")] == ["https://mirror.example/prefix",
                                                                  "https://registry-1.docker.io"]
    assert registry.endpoints("quay.io")[0].base == "https://quay.io"  # the mirror is for docker.io only


def test_credentials_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def auth(user: str, pw: str) -> dict[str, str]:
        return {"auth": base64.b64encode(f"{user}:{pw}".encode()).decode()}

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / ".docker").mkdir()
    (tmp_path / ".docker/config.json").write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": auth("hub", "1"), "ghcr.io": auth("gh", "2")}}))
    assert registry.credentials(parse("python")) == ("hub", "1")
    assert registry.credentials(parse("ghcr.io/o/r")) == ("gh", "2")
    assert registry.credentials(parse("quay.io/o/r")) is None
    # podman's file comes first; a namespace entry beats the registry's.
    (tmp_path / "run/containers").mkdir(parents=True)
    (tmp_path / "run/containers/auth.json").write_text(json.dumps({"auths": {
        "ghcr.io": auth("pod", "3"), "ghcr.io/team": auth("team", "4")}}))
    assert registry.credentials(parse("ghcr.io/o/r")) == ("pod", "3")
    assert registry.credentials(parse("ghcr.io/team/app")) == ("team", "4")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"auths": {"ghcr.io": {"username": "env", "password": "5"}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(other))
    assert registry.credentials(parse("ghcr.io/o/r")) == ("env", "5")


def test_platform_selection() -> None:
    arm, att, amd, v7 = ("sha256:" + c * 64 for c in "abcd")
    index = {"manifests": [
        {"digest": arm, "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
        {"digest": att, "platform": {"os": "unknown", "architecture": "unknown"}},
        {"digest": amd, "platform": {"os": "linux", "architecture": "amd64"}},
        {"digest": v7, "platform": {"os": "linux", "architecture": "arm", "variant": "v7"}},
    ]}
    assert oci.select_manifest(index, oci.Platform.parse("linux/amd64"))["digest"] == amd
    assert oci.select_manifest(index, oci.Platform.parse("arm64"))["digest"] == arm
    assert oci.select_manifest(index, oci.Platform.parse("linux/arm/v7"))["digest"] == v7
    with pytest.raises(Exception, match="no variant for linux/s390x.*linux/amd64"):
        oci.select_manifest(index, oci.Platform.parse("linux/s390x"))
    # What the index names must be a digest: it becomes a path and a URL.
    index["manifests"][2]["digest"] = "sha256:../../../v2/other/manifests/latest"
    with pytest.raises(NsboxError, match="invalid digest"):
        oci.select_manifest(index, oci.Platform.parse("linux/amd64"))
    assert oci.Platform.current().os == "linux"


def test_config_and_user_policy() -> None:
    cfg = ImageConfig.parse({"architecture": "amd64", "os": "linux", "config": {
        "Env": ["PATH=/usr/bin", "A=b=c"], "WorkingDir": "/srv", "User": "app", "Entrypoint": ["/entry"],
        "Cmd": ["serve", "-v"], "ExposedPorts": {"80/tcp": {}}, "Volumes": {"/data": {}}},
        "rootfs": {"type": "layers", "diff_ids": [DIGEST]}})
    assert cfg.env == {"PATH": "/usr/bin", "A": "b=c"}
    assert (cfg.workdir, cfg.user, cfg.exposed_ports, cfg.volumes) == ("/srv", "app", ["80/tcp"], ["/data"])
    assert cfg.command == ["/entry", "serve", "-v"] and cfg.command_for(["x"]) == ["/entry", "x"]
    assert cfg.merge_env({"A": "mine"}) == {"PATH": "/usr/bin", "A": "mine"}
    single = idmap.IdMap("single", ((0, 1000, 1),), ((0, 1000, 1),), "test")
    sub = idmap.IdMap("subuid", ((0, 1000, 1), (1, 100000, 65536)), ((0, 1000, 1), (1, 100000, 65536)), "test")
    user, note = cfg.effective_user(single)
    assert user == "root" and note and "USER app" in note
    assert cfg.effective_user(sub) == ("app", None)
    assert cfg.effective_user(single, "nobody") == ("nobody", None)  # the sandbox's own setting wins
