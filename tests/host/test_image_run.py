"""Sandboxes made from images: Sandbox(image=...), `nsbox run --image`, and
Inspect's conformance checks on a sandbox made from a pulled image.

The image (busybox with a second layer adding user `app`, USER app,
WORKDIR /srv, ENV GREETING, Cmd `echo $GREETING`) is built by umoci and
served by a docker-registry on 127.0.0.1 (tests/imagekit.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import nsbox
from nsbox.inspect.provider import NsboxConfig
from nsbox.sandbox import confined
from nsbox.storage import Store
from nsbox.storage.resolve import resolve

from tests.conftest import MODE
from tests.imagekit import Registry, busybox_oci, fixture_tar, push, registry, self_check_failures, umoci_image  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def debian_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    """The Debian fixture as a one-layer image (it has adduser, which
    Inspect's checks use), with a non-root user's home as WORKDIR."""
    layout = tmp_path_factory.mktemp("debian-oci") / "debian"
    umoci_image(layout, "1", fixture_tar("debian"), "--config.workingdir=/root")
    ref = f"{registry.host}/run/debian:1"
    push(f"oci:{layout}:1", registry, "run/debian:1")
    yield ref
    anyio.run(Store().remove, ref)


@pytest.fixture(scope="module")
def app_image(registry: Registry, busybox_oci: Path) -> Any:  # noqa: F811
    ref = f"{registry.host}/run/app:1"
    push(f"oci:{busybox_oci}:app", registry, "run/app:1")
    yield ref
    anyio.run(Store().remove, ref)


async def test_image_config_applies(app_image: str) -> None:
    async with nsbox.Sandbox(image=app_image) as sb:
        assert sb.image is not None and str(sb.rootfs) == app_image
        r = await sb.exec(["sh", "-c", "id -u; pwd; echo $GREETING"])
        uid = "0" if MODE.mode == "single" else "1000"  # single: the image's USER runs as root
        assert r.stdout == f"{uid}\n/srv\nhello world\n", r
        assert sb.image_command() == ["sh", "-c", "echo $GREETING"]
        assert sb.image_command(["echo", "hi"]) == ["echo", "hi"]  # Cmd replaced, no Entrypoint
        # The sandbox's own settings win over the image's.
    async with nsbox.Sandbox(image=app_image, user="root", workdir="/tmp", env={"GREETING": "mine"}) as sb:
        r = await sb.exec(["sh", "-c", "id -u; pwd; echo $GREETING"])
        assert r.stdout == "0\n/tmp\nmine\n", r


async def test_an_image_without_workdir_runs_in_the_root(registry: Registry, busybox_oci: Path) -> None:  # noqa: F811
    """No WORKDIR: commands run in /, as in Docker (they had run in the
    user's home, /root)."""
    push(f"oci:{busybox_oci}:plain", registry, "run/plain:1")
    ref = f"{registry.host}/run/plain:1"
    try:
        async with nsbox.Sandbox(image=ref, user="root") as sb:
            assert (await sb.exec(["pwd"])).stdout == "/\n"
    finally:
        await Store().remove(ref)


async def test_image_sandboxes_are_copy_on_write(app_image: str) -> None:
    async with nsbox.Sandbox(image=app_image, user="root") as a, nsbox.Sandbox(image=app_image, user="root") as b:
        await a.exec(["sh", "-c", "echo changed > /etc/motd; rm /bin/sh.bak 2>/dev/null; touch /srv/only-a"])
        assert not (await b.exec(["test", "-e", "/srv/only-a"])).success
        assert (await b.exec(["cat", "/etc/passwd"])).stdout.startswith("root:")
    # The shared layers were not touched.
    image = await resolve(Store(runner=confined), app_image, pull="never")
    assert not any((layer / "srv" / "only-a").exists() for layer in image.layers)


async def test_what_a_new_sandbox_finds_in_an_image_is_read_once(
        app_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image's users and working directory are read inside its first
    sandbox only: layers never change and a new sandbox's writable layer is
    empty. A sandbox with binds or tmpfs mounts (which may cover them) reads its own, and a
    user created in one sandbox is not taken for the image's."""
    reads: list[str] = []
    from nsbox.init import users

    real = users.identity_files

    async def counted(client: object) -> tuple[bytes, bytes]:
        reads.append(repr(client))
        return await real(client)  # type: ignore[arg-type]

    monkeypatch.setattr(users, "identity_files", counted)
    monkeypatch.setattr(users, "_image_identity_files", {})
    monkeypatch.setattr(users, "_image_workdirs", {})
    async with nsbox.Sandbox(image=app_image) as a:
        assert len(reads) == 1
        assert (await a.exec(["id", "-un"])).stdout.strip() == ("root" if MODE.mode == "single" else "app")
        await a.exec(["sh", "-c", "echo 'app:x:4242:4242::/elsewhere:/bin/sh' >> /etc/passwd"], user="root")
    before = len(reads)  # a's start, and its own lookup of "root"
    async with nsbox.Sandbox(image=app_image) as b:
        assert len(reads) == before, reads  # b read nothing: the image's, as a found them
        assert (await b.exec(["sh", "-c", "id -u; pwd"])).stdout == ("0" if MODE.mode == "single" else "1000") + "\n/srv\n"
        assert b.workdir == "/srv"
    bound = tmp_path / "bound"
    bound.mkdir()
    async with nsbox.Sandbox(image=app_image, mounts=[nsbox.spec.Bind(str(bound), "/mnt/b")]) as c:
        assert len(reads) == before + 1, reads  # c read its own
        assert (await c.exec(["pwd"])).stdout == "/srv\n"
    # A tmpfs on /srv hides the image's WORKDIR: made again, as Docker does.
    async with nsbox.Sandbox(image=app_image, tmpfs=["/srv"]) as d:
        assert len(reads) == before + 2, reads
        assert (await d.exec(["sh", "-c", "pwd; stat -f -c %T ."])).stdout == "/srv\ntmpfs\n"


def test_cli_runs_an_image(app_image: str) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nsbox", "run", "--image", app_image, *args],
                              capture_output=True, text=True, timeout=60)

    r = run()  # the image's Cmd, as `docker run` runs it
    assert (r.returncode, r.stdout) == (0, "hello world\n"), r.stderr
    r = run("--", "sh", "-c", "echo $GREETING from $(pwd)")
    assert (r.returncode, r.stdout) == (0, "hello world from /srv\n"), r.stderr
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--image", "localhost:1/nothing/here:1", "--pull",
                        "never", "--", "true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 125 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


async def test_inspect_conformance_on_a_pulled_image(debian_image: str) -> None:
    """Inspect's sandbox self-check on sandboxes made from a pulled image."""
    failures = await self_check_failures("image-conformance", NsboxConfig(image=debian_image))
    # As in tests/test_inspect_conformance.py: root bypasses file modes (as
    # in Docker), and one mapped uid cannot run other users.
    expected = {"test_read_file_not_allowed", "test_write_text_file_without_permissions",
                "test_write_binary_file_without_permissions"}
    if MODE.mode == "single":
        expected.add("test_exec_as_user")
    failed = {f.split(":")[0] for f in failures}
    assert failed == expected, "\n".join(failures)
