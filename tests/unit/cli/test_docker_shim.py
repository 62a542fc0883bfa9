"""The docker shim: `nsbox docker-shim install --prefix DIR` writes a
`docker` script that answers what evaluations ask the Docker CLI while they
build their tasks, from nsbox's store and compose reader; it is run here
as a subprocess, the way task code runs it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nsbox.cli import docker_shim
from nsbox.storage import Store

from tests.host.test_build import _base

pytestmark = pytest.mark.timeout(300)


def _install(prefix: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsbox", "docker-shim", "install", "--prefix", str(prefix)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def docker(tmp_path: Path) -> Path:
    r = _install(tmp_path / "prefix")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "prefix" / "bin" / "docker"
    assert r.stdout.strip() == str(path) and os.access(path, os.X_OK)
    return path


def run(docker: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(docker), *args], capture_output=True, text=True, timeout=240, cwd=cwd)


def test_compose_config_lists_images_and_services(docker: Path, tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text("FROM busybox\n")
    (tmp_path / "compose.yaml").write_text(textwrap.dedent("""\
        name: ctf
        services:
          default:
            image: registry.example/evals/agent:1
            depends_on: [victim]
          victim:
            build: ./ctx
            volumes: [data:/srv]
        volumes:
          data:
        """))
    r = run(docker, "compose", "-f", str(tmp_path / "compose.yaml"), "config", "--images")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["registry.example/evals/agent:1", "ctf-victim"]
    r = run(docker, "compose", "-p", "other", "config", "--images", cwd=tmp_path)  # compose.yaml found here
    assert r.stdout.split() == ["registry.example/evals/agent:1", "other-victim"], r.stderr
    r = run(docker, "compose", "config", "--services", cwd=tmp_path)
    assert (r.returncode, r.stdout.split()) == (0, ["default", "victim"]), r.stderr
    r = run(docker, "compose", "-f", str(tmp_path / "compose.yaml"), "config", "--format", "json")
    doc = json.loads(r.stdout)
    assert doc["services"]["victim"]["build"]["context"] == str(tmp_path / "ctx")
    assert doc["services"]["victim"]["volumes"] == [{"type": "volume", "source": "data", "target": "/srv"}]
    assert doc["volumes"] == {"data": {"name": "ctf_data"}}
    r = run(docker, "compose", "config", "-o", str(tmp_path / "out.yaml"), cwd=tmp_path)
    assert r.returncode == 0 and "ctf_data" in (tmp_path / "out.yaml").read_text(), r.stderr
    for bad, why in ((tmp_path / "missing" / "x", "No such file or directory"), (tmp_path, "Is a directory")):
        r = run(docker, "compose", "config", "-o", str(bad), cwd=tmp_path)
        assert (r.returncode, r.stderr) == (1, f"Error: cannot write {bad}: {why}\n")


def test_image_inspect_answers_as_docker_does(docker: Path) -> None:
    ref = _base("busybox")
    r = run(docker, "image", "inspect", ref)
    assert r.returncode == 0, r.stderr
    [info] = json.loads(r.stdout)
    rec = Store().lookup(ref)
    assert info["Id"] == rec.id and ref in info["RepoTags"]
    assert info["Os"] == "linux" and info["Architecture"]
    assert set(info["Config"]) >= {"Env", "Cmd", "Entrypoint", "WorkingDir", "User"}
    assert info["RootFS"]["Layers"] == [layer["diff_id"] for layer in Store().inspect(ref)["layers"]]
    r = run(docker, "inspect", "--type", "image", "--format", "{{.Id}} {{json .RepoTags}}", ref)
    assert r.stdout.split(" ", 1) == [rec.id, json.dumps(info["RepoTags"]) + "\n"], r.stderr
    r = run(docker, "images", "-q", "--no-trunc")
    assert rec.id in r.stdout.split(), r.stderr
    r = run(docker, "image", "inspect", ref, "nsbox-test/absent:1")
    assert r.returncode == 1 and "Error: No such image: nsbox-test/absent:1" in r.stderr
    assert json.loads(r.stdout)[0]["Id"] == rec.id  # what was found is still printed, as Docker does


def test_images_names_a_repositorys_tags_as_docker_prints_them(docker: Path) -> None:
    import anyio

    rec = Store().lookup(_base("busybox"))
    repo = f"nsbox-shim-{os.getpid()}"
    for tag in ("1", "2"):
        anyio.run(lambda: Store().tag(f"docker.io/library/{repo}:{tag}", rec.digest, source="test"))
    anyio.run(lambda: Store().tag(f"docker.io/{repo}-other:1", rec.digest, source="test"))
    r = run(docker, "images", repo, "--format", "{{.Repository}} {{.Tag}}")
    assert (r.returncode, r.stdout.splitlines()) == (0, [f"{repo} 1", f"{repo} 2"]), r.stderr
    r = run(docker, "images", f"{repo}:2", "--format", "{{.Repository}}:{{.Tag}}")
    assert r.stdout.splitlines() == [f"{repo}:2"], r.stderr
    r = run(docker, "images", f"{repo}-absent", "-q")
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
    r = run(docker, "image", "inspect", "--format", "{{json .RepoTags}}", f"{repo}:1")
    tags = json.loads(r.stdout)
    assert {f"{repo}:1", f"{repo}:2", f"{repo}-other:1"} <= set(tags), tags
    assert not any(t.startswith("docker.io/") for t in tags), tags


@pytest.mark.parametrize("args, what", [
    (["run", "busybox"], "docker run"),
    (["compose", "up", "-d"], "docker compose up"),
    (["image", "rm", "x"], "docker image rm"),
    (["ps"], "docker ps"),
    (["compose", "config", "--hash", "x"], "docker compose config --hash"),
])
def test_what_it_does_not_do_fails_clearly(docker: Path, args: list[str], what: str) -> None:
    r = run(docker, *args)
    assert r.returncode == 1
    assert f"nsbox's docker shim does not do `{what}`" in r.stderr and "Traceback" not in r.stderr


def test_version_and_info(docker: Path) -> None:
    r = run(docker, "version", "--format", "{{.Server.ApiVersion}}")
    assert (r.returncode, r.stdout.strip()) == (0, "1.43"), r.stderr
    r = run(docker, "info")
    assert r.returncode == 0 and "nsbox" in r.stdout


def test_the_installer_never_overwrites_another_docker(tmp_path: Path, docker: Path) -> None:
    other = tmp_path / "other" / "bin" / "docker"
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\necho the real docker\n")
    r = _install(tmp_path / "other")
    assert r.returncode == 1 and "is not nsbox's docker shim: not overwriting it" in r.stderr
    assert other.read_text() == "#!/bin/sh\necho the real docker\n"
    other.unlink()
    other.symlink_to(docker)  # a link to a shim is still someone else's file
    assert _install(tmp_path / "other").returncode == 1 and other.is_symlink()
    other.unlink()
    os.mkfifo(other)  # a FIFO is refused, not read (a read would wait for ever)
    r = _install(tmp_path / "other")
    assert r.returncode == 1 and "not nsbox's docker shim" in r.stderr
    # A file planted under the name a fixed temporary name would have (this
    # process's pid: install() runs here) is left alone.
    bin_dir = tmp_path / "prefix" / "bin"
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    planted = bin_dir / f".docker.{os.getpid()}"
    planted.symlink_to(victim)
    docker_shim.install(tmp_path / "prefix")  # over its own shim: an update
    assert victim.read_text() == "keep\n" and stat.S_IMODE(victim.stat().st_mode) != 0o755
    assert docker_shim.MARK in (bin_dir / "docker").read_text()
    assert [p.name for p in bin_dir.glob(".docker.*")] == [planted.name]
