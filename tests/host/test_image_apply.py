"""The layer applier against hostile and damaged layers.

Each layer is imported from an OCI layout (the same applier serves pulls).
Whatever the layer says, nothing may appear outside the layer directory and
no host file may change; what is skipped is summed up in one line.
"""

from __future__ import annotations

import gzip
import logging
import os
import secrets
import stat
import tarfile
from pathlib import Path

import pytest

from nsbox.errors import NsboxError
from nsbox.storage.apply import CorruptLayer
from nsbox.storage.archive import import_image
from nsbox.storage.store import Store

from tests.conftest import MODE
from tests.imagekit import Layout, add, busybox_layer, run_image, snapshot, store, tar_bytes  # noqa: F401

pytestmark = pytest.mark.timeout(60)


async def test_hostile_layer_stays_inside(tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    os.chmod(tmp_path, 0o755)
    outside = tmp_path / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel"
    sentinel.write_text("untouched\n")
    os.chmod(outside, 0o777)  # writable by anyone: only the applier's rules protect it
    os.chmod(sentinel, 0o666)
    tag = secrets.token_hex(4)

    def hostile(t: tarfile.TarFile) -> None:
        add(t, f"../escape-{tag}", b"dotdot")
        add(t, f"a/../../escape2-{tag}", b"dotdot")
        add(t, f"/abs-{tag}", b"absolute, made relative")
        add(t, "link", type=tarfile.SYMTYPE, linkname=str(outside))
        add(t, "link/through-symlink", b"via an absolute symlink")
        add(t, "link/.wh.sentinel")  # a whiteout through the symlink
        add(t, "link/.wh..wh..opq")  # an opaque marker through it
        add(t, "up", type=tarfile.SYMTYPE, linkname="../../../../../../../../..")
        add(t, f"up{outside}/sentinel", b"via a relative symlink")
        add(t, "hard", type=tarfile.LNKTYPE, linkname=str(sentinel))
        add(t, "hard2", type=tarfile.LNKTYPE, linkname="../../outside/sentinel")
        add(t, "hard3", type=tarfile.LNKTYPE, linkname="link/sentinel")  # through a symlink
        # A regular file replaced by a symlink to the host, then written again.
        add(t, "f", b"one")
        add(t, "f", type=tarfile.SYMTYPE, linkname=str(sentinel))
        add(t, "f", b"two")
        # A hardlink to a symlink pointing out, then written through.
        add(t, "s", type=tarfile.SYMTYPE, linkname=str(sentinel))
        add(t, "hs", type=tarfile.LNKTYPE, linkname="s")
        add(t, "hs", b"replaced")
        add(t, "dev", type=tarfile.DIRTYPE)
        add(t, "dev/evil", type=tarfile.CHRTYPE, devmajor=1, devminor=3)
        add(t, "dev/disk", type=tarfile.BLKTYPE, devmajor=8, devminor=0)
        add(t, "dev/fifo", type=tarfile.FIFOTYPE)
        # Overlay's own xattrs would steer the mount: dropped.
        add(t, "steer", type=tarfile.DIRTYPE, xattrs={"user.overlay.opaque": "y", "trusted.overlay.redirect": "/x",
                                                      "user.kept": "yes"})
        add(t, ".wh.", b"")
        add(t, "ro", type=tarfile.DIRTYPE, mode=0o555)
        add(t, "ro/file", b"inside a read-only dir")

    layout = Layout(tmp_path / "layout")
    layout.tag("hostile", layout.image([busybox_layer(), tar_bytes(hostile)]))
    host_before = snapshot(tmp_path, skip=store.root)
    caplog.set_level(logging.WARNING, "nsbox.storage.tarball")
    image = await import_image(store, layout.path, name="hostile:1")
    top = image.layers[-1]
    assert snapshot(tmp_path, skip=store.root) == host_before
    assert sentinel.read_text() == "untouched\n" and os.listxattr(outside) == []
    assert not Path(f"/abs-{tag}").exists() and not Path(f"/escape-{tag}").exists()
    for parent in (top.parent, store.root, store.layers_root, tmp_path):
        assert not any("escape" in p.name for p in parent.iterdir()), parent
    assert (top / f"abs-{tag}").read_bytes() == b"absolute, made relative"
    assert os.readlink(top / "link") == str(outside)  # kept as written: it resolves inside the sandbox
    assert (top / "f").read_bytes() == b"two" and not (top / "f").is_symlink()
    assert (top / "hs").read_bytes() == b"replaced" and (top / "s").is_symlink()
    assert not (top / "hard").exists() and not (top / "hard2").exists() and not (top / "hard3").exists()
    assert not (top / "dev/evil").exists() and not (top / "dev/disk").exists()
    assert stat.S_ISFIFO(os.lstat(top / "dev/fifo").st_mode)
    assert os.listxattr(top / "steer") == ["user.kept"]
    assert stat.S_IMODE(os.lstat(top / "ro").st_mode) == 0o555 and (top / "ro/file").is_file()
    assert sorted(p.name for p in top.iterdir()) == sorted(
        [f"abs-{tag}", "link", "up", "f", "s", "hs", "dev", "steer", "ro"])
    # One summary line says what was skipped.
    notes = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "2 device nodes" in notes[0] and "unsafe members" in notes[0] and "hardlinks" in notes[0]
    # And inside the sandbox, the symlinks lead nowhere on the host.
    async with run_image(image) as sb:
        r = await sb.exec(["sh", "-c", "cat /link/sentinel /f; ls /up/ | head -3"])
        assert "untouched" not in r.stdout and "two" in r.stdout


async def test_links_modes_owners_xattrs_kept(tmp_path: Path, store: Store) -> None:
    def layer(t: tarfile.TarFile) -> None:
        add(t, "./", type=tarfile.DIRTYPE, mode=0o755)
        add(t, "opt", type=tarfile.DIRTYPE)
        add(t, "opt/tool", b"#!/bin/sh\necho tool\n", mode=0o4755)
        add(t, "opt/sgid", b"x", mode=0o2750, uid=0, gid=42)
        add(t, "opt/hard", type=tarfile.LNKTYPE, linkname="opt/tool")
        add(t, "opt/abs", type=tarfile.SYMTYPE, linkname="/opt/tool")
        add(t, "opt/rel", type=tarfile.SYMTYPE, linkname="../opt/tool")
        add(t, "opt/owned", b"y", uid=1000, gid=1000, mode=0o640)
        add(t, "opt/cap", b"z", xattrs={"user.comment": "hi"})
        add(t, "opt/link-owned", type=tarfile.SYMTYPE, linkname="owned", uid=1000, gid=1000)
        add(t, "big", type=tarfile.DIRTYPE, uid=70000, gid=70000)  # beyond every mapping: stays root's

    layout = Layout(tmp_path / "layout")
    layout.tag("keep", layout.image([busybox_layer(), tar_bytes(layer)]))
    image = await import_image(store, layout.path, tag="keep")
    top = image.layers[-1]
    assert os.lstat(top / "opt/hard").st_ino == os.lstat(top / "opt/tool").st_ino
    assert os.getxattr(top / "opt/cap", "user.comment") == b"hi"
    async with run_image(image) as sb:
        r = await sb.exec(["stat", "-c", "%u:%g %a %N", "/opt/tool", "/opt/sgid", "/opt/owned", "/opt/abs",
                           "/opt/rel", "/opt/link-owned", "/big"])
        lines = r.stdout.splitlines()
        one = "0:0" if MODE.mode == "single" else "1000:1000"
        lines = [line.replace("'", "") for line in lines]  # busybox stat does not quote
        assert lines[0] == "0:0 4755 /opt/tool"
        assert lines[1] == ("0:0" if MODE.mode == "single" else "0:42") + " 2750 /opt/sgid"
        assert lines[2] == f"{one} 640 /opt/owned"
        assert lines[3].endswith("/opt/abs -> /opt/tool") and lines[4].endswith("-> ../opt/tool")
        assert lines[5].startswith(one)
        assert lines[6].startswith("0:0")
        assert (await sb.exec(["/opt/abs"])).stdout == "tool\n"


def _layout_with_raw_layer(tmp_path: Path, blob: bytes, diff_id: str | None = None) -> Path:
    """A one-layer image whose layer blob is `blob` as given (digest matching it)."""
    import hashlib
    import json

    layout = Layout(tmp_path / "raw")
    desc = layout.image([b""], compress=False)  # placeholder, replaced below
    ldesc = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layout.blob(blob)}
    cfg = {"architecture": "amd64", "os": "linux", "config": {},
           "rootfs": {"type": "layers", "diff_ids": [diff_id or "sha256:" + hashlib.sha256(b"").hexdigest()]}}
    cdesc = {"mediaType": "application/vnd.oci.image.config.v1+json", **layout.blob(json.dumps(cfg).encode())}
    manifest = {"schemaVersion": 2, "config": cdesc, "layers": [ldesc],
                "mediaType": "application/vnd.oci.image.manifest.v1+json"}
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **layout.blob(json.dumps(manifest).encode())}
    layout.tag("raw", desc)
    return layout.path


def _nothing_published(store: Store) -> None:
    assert store.records() == {}
    assert not list(store.tmp.iterdir())
    for key in store.layers_root.iterdir():
        assert list(key.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated-gzip", "truncated-tar", "garbage", "wrong-diff-id"])
async def test_damaged_layer_publishes_nothing(tmp_path: Path, store: Store, damage: str) -> None:
    import hashlib

    raw = tar_bytes(lambda t: add(t, "file", os.urandom(300_000)))
    diff_id = None
    if damage == "truncated-gzip":
        blob = gzip.compress(raw)[:50_000]
    elif damage == "truncated-tar":
        blob = gzip.compress(raw[:100_000])
    elif damage == "garbage":
        blob = b"\x1f\x8b" + os.urandom(5000)
    else:
        blob = gzip.compress(raw)
        diff_id = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(CorruptLayer) as info:
        await import_image(store, _layout_with_raw_layer(tmp_path, blob, diff_id), name="damaged:1")
    message = str(info.value)
    assert "\n" not in message
    assert ("image config says" in message) if damage == "wrong-diff-id" else ("corrupt or truncated" in message)
    _nothing_published(store)


async def test_layout_blob_not_matching_its_digest(tmp_path: Path, store: Store) -> None:
    path = _layout_with_raw_layer(tmp_path, gzip.compress(tar_bytes(lambda t: add(t, "f", b"x"))))
    for blob in (path / "blobs/sha256").iterdir():
        if blob.read_bytes()[:2] == b"\x1f\x8b":
            blob.write_bytes(gzip.compress(tar_bytes(lambda t: add(t, "f", b"y"))))
    with pytest.raises(NsboxError, match="does not match its digest|bytes, not|larger than its"):
        await import_image(store, path, name="tampered:1")
    _nothing_published(store)
