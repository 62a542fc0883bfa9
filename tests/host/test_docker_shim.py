"""The docker shim's build and pull (see tests/unit/cli/test_docker_shim.py):
a build runs a sandbox, a pull reads a docker-registry on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsbox.storage import Store

from tests.imagekit import Registry, busybox_oci, push, registry  # noqa: F401 (fixtures)
from tests.host.test_build import _base
from tests.unit.cli.test_docker_shim import docker, run  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)


def test_build_and_pull_go_to_the_store(docker: Path, tmp_path: Path, registry: Registry,  # noqa: F811
                                        busybox_oci: Path) -> None:  # noqa: F811
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {_base('busybox')}\nRUN echo built > /built\n")
    r = run(docker, "build", "-q", "-t", "localhost/nsbox-shim-built:1", str(ctx))
    assert r.returncode == 0, r.stderr
    assert Store().lookup("localhost/nsbox-shim-built:1").id == r.stdout.strip()
    push(f"oci:{busybox_oci}:plain", registry, "shim/busybox:1")
    r = run(docker, "pull", "-q", f"{registry.host}/shim/busybox:1")
    assert r.returncode == 0, r.stderr
    r = run(docker, "image", "inspect", "-f", "{{.Id}}", f"{registry.host}/shim/busybox:1")
    assert r.stdout.strip() == Store().lookup(f"{registry.host}/shim/busybox:1").id
