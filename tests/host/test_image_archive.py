"""Imports: docker-archive (skopeo writes it as `docker save` does), OCI layout
and oci-archive, rootfs tarballs, directories; and the `nsbox image` CLI."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from nsbox.errors import NsboxError
from nsbox.storage.archive import import_image
from nsbox.cli.image import image as image_cli
from nsbox.storage.store import Image, Store

from tests.conftest import MODE
from tests.imagekit import Layout, busybox_oci, fixture_tar, need, run_image, store, tool  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def skopeo(src: str, dest: str) -> None:
    need("skopeo")
    r = subprocess.run([tool("skopeo"), "copy", "-q", src, dest], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


async def _check_app(image: Image, name: str) -> None:
    assert image.name == name and image.config.user == "app" and image.config.workdir == "/srv"
    async with run_image(image) as sb:
        r = await sb.exec(["stat", "-c", "%u", "/home/app/notes.txt"])
        assert r.stdout == ("0\n" if MODE.mode == "single" else "1000\n")


async def test_docker_archive(busybox_oci: Path, store: Store, tmp_path: Path) -> None:
    archive = tmp_path / "app.tar"
    skopeo(f"oci:{busybox_oci}:app", f"docker-archive:{archive}:example.com/team/app:2")
    image = await import_image(store, archive)
    await _check_app(image, "example.com/team/app:2")
    # `docker save | gzip` is accepted too; --name renames; layers are shared.
    subprocess.run(["gzip", "-k", archive], check=True)
    again = await import_image(store, f"{archive}.gz", name="renamed")
    assert again.name == "docker.io/library/renamed:latest" and again.layers == image.layers
    assert set(store.records()) == {"example.com/team/app:2", "docker.io/library/renamed:latest"}


async def test_oci_layout_and_archive(busybox_oci: Path, store: Store, tmp_path: Path) -> None:
    with pytest.raises(NsboxError, match="holds 2 images.*--tag"):
        await import_image(store, busybox_oci)
    image = await import_image(store, busybox_oci, tag="app")
    await _check_app(image, "localhost/busybox:app")
    archive = tmp_path / "app.oci.tar"
    skopeo(f"oci:{busybox_oci}:app", f"oci-archive:{archive}:app")
    from_archive = await import_image(store, archive, name="mine:1")
    assert from_archive.name == "docker.io/library/mine:1" and from_archive.layers == image.layers


@pytest.mark.parametrize("compress", ["", "gz", "zst"])
async def test_rootfs_tarball(store: Store, tmp_path: Path, compress: str) -> None:
    src = fixture_tar("busybox")
    path = tmp_path / "bb.tar"
    shutil.copy(src, path)
    if compress:
        need(*(["zstd"] if compress == "zst" else []))
        subprocess.run({"gz": ["gzip"], "zst": ["zstd", "-q", "--rm"]}[compress] + [str(path)], check=True)
        path = tmp_path / f"bb.tar.{compress}"
    image = await import_image(store, path)
    assert image.name == "localhost/bb:latest" and len(image.layers) == 1
    async with run_image(image) as sb:
        assert (await sb.exec(["busybox", "echo", "ok"])).stdout == "ok\n"


async def test_directory(busybox_oci: Path, store: Store, tmp_path: Path) -> None:
    app = await import_image(store, busybox_oci, tag="app")
    # The unpacked top layer holds files of uid 1000: they stay 1000's.
    image = await import_image(store, app.layers[-1], name="dir:1")
    assert image.layers[-1] != app.layers[-1]
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc/motd").write_text("hi\n")
    mine = await import_image(store, src, name="tree:1")
    assert (mine.layers[0] / "etc/motd").read_text() == "hi\n"
    # The directory's copy of the layer, stacked on busybox instead of the original.
    stacked = dataclasses.replace(app, layers=(*app.layers[:1], image.layers[-1]))
    async with run_image(stacked) as sb:
        r = await sb.exec(["stat", "-c", "%u %a", "/home/app/notes.txt", "/usr/local/bin/suid"])
        assert r.stdout == ("0 600\n0 4755\n" if MODE.mode == "single" else "1000 600\n0 4755\n"), r


def test_cli(busybox_oci: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "state"))
    runner = CliRunner()
    r = runner.invoke(image_cli, ["import", "--tag", "app", "--name", "app:1", str(busybox_oci)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(image_cli, ["ls", "--json"])
    listed = json.loads(r.output)
    assert [i["name"] for i in listed] == ["docker.io/library/app:1"] and listed[0]["source"] == "oci"
    r = runner.invoke(image_cli, ["inspect", "--json", "app:1"])
    info = json.loads(r.output)
    assert info["config"]["User"] == "app" and len(info["layers"]) == 2 and all(x["unpacked"] for x in info["layers"])
    r = runner.invoke(image_cli, ["ls"])
    assert "app:1" in r.output and "IMAGE ID" in r.output
    r = runner.invoke(image_cli, ["inspect", "nothing:1"])
    assert r.exit_code == 1 and "not in the store" in r.output
    r = runner.invoke(image_cli, ["rm", "app:1"])
    assert r.exit_code == 0 and "untagged docker.io/library/app:1" in r.output and "deleted 2 layers" in r.output
    assert json.loads(runner.invoke(image_cli, ["ls", "--json"]).output) == []
    store = Store(tmp_path / "state/data/images")
    assert not list(store.blobs.joinpath("sha256").iterdir())
    from nsbox.create.unshare import remove_layer
    remove_layer(tmp_path / "state", MODE)


def test_archive_member_names_are_not_paths(tmp_path: Path, store: Store) -> None:
    import anyio

    # A docker-archive whose manifest names a layer outside the archive.
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as t:
        data = json.dumps([{"Config": "c.json", "Layers": ["../../etc/passwd"], "RepoTags": ["x:1"]}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
        cfg = json.dumps({"rootfs": {"diff_ids": ["sha256:" + "0" * 64]}}).encode()
        info = tarfile.TarInfo("c.json")
        info.size = len(cfg)
        t.addfile(info, io.BytesIO(cfg))
    with pytest.raises(NsboxError, match="no file ../../etc/passwd"):
        anyio.run(import_image, store, bad)


async def test_a_compressed_oci_archive_is_named_after_its_file(tmp_path: Path, store: Store) -> None:
    """A tag of a compressed oci-archive names the image after the file
    (it had been named after the decompressed temp copy: 32659-92d52c297753)."""
    layout = Layout(tmp_path / "layout")
    layout.tag("1", layout.image([fixture_tar("busybox").read_bytes()]))
    src = tmp_path / "my-app.tar.gz"
    with tarfile.open(src, "w:gz") as tf:
        for name in ("oci-layout", "index.json", "blobs"):
            tf.add(layout.path / name, arcname=name)
    image = await import_image(store, src)
    assert image.name == "localhost/my-app:1"
