"""Hostile image files and configs that fail before any layer is unpacked
(so no sandbox: the store has no runner): bounded decompression and
headers, capped configs, symlink loops, bad JSON, Healthcheck types; the
overlay's lower dirs; the CLI's display of config text."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from nsbox.errors import NsboxError
from nsbox.storage import archive, oci
from nsbox.storage.config import ImageConfig
from nsbox.storage.store import Store

from tests.imagekit import Layout, add, tar_bytes

pytestmark = pytest.mark.timeout(60)

LAYER = tar_bytes(lambda t: add(t, "f", b"x"))


def _config(extra: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": extra or {},
                       "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(LAYER).hexdigest()]}
                       }).encode()


def _docker_archive(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    def build(t: tarfile.TarFile) -> None:
        for name, target in (links or {}).items():
            add(t, name, type=tarfile.SYMTYPE, linkname=target)
        for name, data in members.items():
            add(t, name, data)
    return tar_bytes(build)


def _image_members(config: bytes) -> dict[str, bytes]:
    manifest = [{"Config": "config.json", "RepoTags": ["localhost/x:1"], "Layers": ["layer.tar"]}]
    return {"manifest.json": json.dumps(manifest).encode(), "config.json": config, "layer.tar": LAYER}


def _no_leftovers(store: Store) -> None:
    assert store.records() == {} and list(store.tmp.iterdir()) == []


async def test_a_compressed_archive_is_decompressed_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 MiB of zeros in a gzipped docker-archive (64 KiB of it): stopped at
    the image's bound, not written whole to the store's tmp first."""
    monkeypatch.setenv("NSBOX_IMAGE_LIMITS", "layer-size=8M,size=8M")
    members = {**_image_members(_config()), "blobs/junk": bytes(64 << 20)}
    src = tmp_path / "bomb.tar.gz"
    src.write_bytes(gzip.compress(_docker_archive(members), compresslevel=1))
    store = Store(tmp_path / "store")
    with pytest.raises(NsboxError, match=r"archive bomb.tar.gz unpacks to more than 8 MiB.*NSBOX_IMAGE_LIMITS"):
        await archive.import_image(store, src)
    _no_leftovers(store)


def _pax_first(size: int, then: bytes) -> bytes:
    """A tar whose first member has a PAX header of `size` bytes."""
    record = b" comment=" + b"z" * size + b"\n"
    record = str(len(record) + len(str(len(record) + 7))).encode() + record
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, len(record)
    return header.tobuf(tarfile.USTAR_FORMAT) + record + bytes(-len(record) % 512) + then


def test_a_huge_pax_header_is_not_read(tmp_path: Path) -> None:
    """tarfile reads an extended header whole: 256 MiB (256 KiB gzipped)
    had been read into the host's memory to look at the first member."""
    src = tmp_path / "pax.tar.gz"
    src.write_bytes(gzip.compress(_pax_first(256 << 20, _docker_archive(_image_members(_config()))),
                                  compresslevel=1))
    tracemalloc.start()
    try:
        assert not archive._looks_like_image_archive(src, "gzip")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak


async def test_an_uncompressed_archive_with_a_huge_pax_header(tmp_path: Path) -> None:
    src = tmp_path / "pax.tar"
    src.write_bytes(_pax_first(2 << 20, _docker_archive({"manifest.json": b"[]"})))
    with pytest.raises(NsboxError, match=r"pax.tar is not a tar archive nsbox reads \(an extended header of"):
        await archive.import_image(Store(tmp_path / "store"), src)


@pytest.mark.parametrize("kind", ["layout", "docker"])
async def test_a_config_over_the_bound_is_not_copied(tmp_path: Path, kind: str) -> None:
    """A pull refuses a config over 4 MiB (MAX_CONFIG); an import had copied
    one of any size into the store and read it whole."""
    config = _config({"Labels": {"junk": "x" * (5 << 20)}})
    if kind == "layout":
        layout = Layout(tmp_path / "layout")
        layout.tag("t", layout.image([LAYER]))
        manifest_path = next(p for p in (layout.path / "blobs/sha256").iterdir() if b'"layers"' in p.read_bytes())
        manifest = json.loads(manifest_path.read_bytes())
        manifest["config"] = {**manifest["config"], **layout.blob(config)}
        layout.index = []
        layout.tag("t", {"mediaType": oci.OCI_MANIFEST, **layout.blob(json.dumps(manifest).encode())})
        src, message = layout.path, f"is larger than {oci.MAX_CONFIG} bytes"
    else:
        src = tmp_path / "docker.tar"
        src.write_bytes(_docker_archive(_image_members(config)))
        message = "config.json is too large for a manifest or config"
    store = Store(tmp_path / "store")
    with pytest.raises(NsboxError, match=message):
        await archive.import_image(store, src)
    assert all(p.stat().st_size < 1 << 20 for p in (store.blobs / "sha256").iterdir())
    _no_leftovers(store)


@pytest.mark.parametrize("manifest, message", [
    (b"", "the archive's manifest.json is not valid JSON"),
    (b"[" * 200_000 + b"]" * 200_000, "the archive's manifest.json is not valid JSON"),
])
async def test_a_docker_manifest_that_is_not_json(tmp_path: Path, manifest: bytes, message: str) -> None:
    src = tmp_path / "docker.tar"
    src.write_bytes(_docker_archive({**_image_members(_config()), "manifest.json": manifest}))
    with pytest.raises(NsboxError, match=message):
        await archive.import_image(Store(tmp_path / "store"), src)


@pytest.mark.parametrize("config, message", [
    (b"not json", "the image config is not a JSON object"),
    (b'{"config": {"Labels": {"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}}}", "the image config is not"),
])
async def test_a_docker_config_that_is_not_json(tmp_path: Path, config: bytes, message: str) -> None:
    src = tmp_path / "docker.tar"
    src.write_bytes(_docker_archive(_image_members(config)))
    with pytest.raises(NsboxError, match=message):
        await archive.import_image(Store(tmp_path / "store"), src)


async def test_a_symlink_loop_in_an_archive(tmp_path: Path) -> None:
    """tarfile follows a member's symlinks until RecursionError; a few are
    followed here (docker save links shared layers), a loop is an error."""
    src = tmp_path / "loop.tar"
    src.write_bytes(_docker_archive({}, {"manifest.json": "b", "b": "manifest.json"}))
    with pytest.raises(NsboxError, match="too many symlinks"):
        await archive.import_image(Store(tmp_path / "store"), src)
    linked = _docker_archive({"real/manifest.json": b"[]"}, {"manifest.json": "./real/../real/manifest.json"})
    with tarfile.open(fileobj=io.BytesIO(linked)) as tf:
        files = archive._Files(tf)
        assert files.member("manifest.json").name == "real/manifest.json"
        assert files.read("manifest.json") == b"[]"


# ---- Healthcheck ------------------------------------------------------------

@pytest.mark.parametrize("health, field", [
    ({"Test": 5}, "Test"),
    ({"Test": ["CMD", 1, None]}, "Test"),
    ({"Test": ["CMD", "true"], "Retries": 10**400}, "Retries"),
    ({"Test": ["CMD", "true"], "Retries": -1}, "Retries"),
    ({"Test": ["CMD", "true"], "Interval": 1e300}, "Interval"),
    ({"Test": ["CMD", "true"], "Timeout": 1 << 63}, "Timeout"),
    ({"Test": ["CMD", "true"], "StartPeriod": "5s"}, "StartPeriod"),
    ([], None),
])
def test_hostile_healthchecks(health: Any, field: str | None) -> None:
    """Checked as the other fields are (a TypeError, an OverflowError had
    come later, from compose's deadline)."""
    doc = json.loads(json.dumps({"config": {"Healthcheck": health}}))
    with pytest.raises(NsboxError, match=f"the image config's Healthcheck{'.' + field if field else ''} is not"):
        ImageConfig.parse(doc)


def test_healthchecks_docker_writes() -> None:
    from nsbox.compose.services import Healthcheck, compose_deadline

    longest = (1 << 63) - 1
    for health in ({"Test": ["CMD-SHELL", "curl -f localhost"], "Interval": 30 * 10**9, "Retries": 3},
                   {"Test": "true"}, {"Test": ["NONE"]}, {"Test": ["CMD", "true"], "Interval": longest,
                                                           "Timeout": longest, "Retries": longest}):
        cfg = ImageConfig.parse({"config": {"Healthcheck": health}})
        assert cfg.healthcheck == health
        check = Healthcheck.from_image(cfg.healthcheck, cfg.shell)
        assert check is None or compose_deadline([check]) > 0


# ---- the overlay's lower dirs -------------------------------------------------

def test_a_layer_twice_is_one_lower_dir(tmp_path: Path) -> None:
    """overlayfs refuses a directory twice in lowerdir (ELOOP): an image with
    a layer twice (`RUN true` twice) has it once, at its topmost place."""
    from nsbox.plan.rootfs import ImageRootfs

    base, empty, top = tmp_path / "base", tmp_path / "empty", tmp_path / "top"
    rootfs = ImageRootfs("x", (base, empty, top, empty))
    assert rootfs.lower_dirs() == [empty, top, base]
    assert ImageRootfs("y", (base, top)).lower_dirs() == [top, base]


# ---- what the CLI shows ------------------------------------------------------

ESC = "\x1b]0;PWNED\x07\x1b[2K\r\x1b[31mFAKE: verified\x1b[0m"


async def test_config_text_is_escaped_for_the_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nsbox.cli.image import image as image_cli

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("NSBOX_STATE_DIR", os.fspath(state))
    store = Store()
    config = json.dumps({"architecture": "amd64", "variant": ESC, "os": "linux",
                         "config": {"Env": [f"X={ESC}"], "Cmd": ["sh", ESC], "User": ESC, "WorkingDir": f"/{ESC}"},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = oci.manifest_doc((store.put_bytes(config), len(config)), [])
    await store.tag("localhost/esc:1", store.put_bytes(manifest), source="oci")
    for args in (["ls"], ["inspect", "localhost/esc:1"]):
        r = CliRunner().invoke(image_cli, args)
        assert r.exit_code == 0, r.output
        assert "\x1b" not in r.output and "\r" not in r.output and "\x07" not in r.output, r.output
        assert "\\x1b]0;PWNED\\x07" in r.output, r.output


PINNED = "docker.io/library/python@sha256:" + "a" * 64


async def test_only_a_pull_by_digest_names_an_image_with_it(tmp_path: Path) -> None:
    """A build or an import named `python@sha256:X` had been stored under
    that name: whoever pinned the real image by its digest then ran it."""
    from nsbox.dockerfile import BuildError, build_image

    store = Store(tmp_path / "store")
    with pytest.raises(NsboxError, match="a name with a digest is only for the image pulled by that digest"):
        await store.tag(PINNED, "sha256:" + "b" * 64, source="build")
    with pytest.raises(BuildError, match="a tag cannot name a digest"):
        await build_image(tmp_path, tag=["ok:1", PINNED])
    src = tmp_path / "image.tar"
    src.write_bytes(_docker_archive(_image_members(_config())))
    with pytest.raises(NsboxError, match="a name with a digest is only for the image pulled by it"):
        await archive.import_image(store, src, name=PINNED)
    _no_leftovers(store)
    # An archive's own name with a digest is not a name it may give itself.
    assert archive._try_normal(PINNED) is None and archive._try_normal("python:3") == "docker.io/library/python:3"
