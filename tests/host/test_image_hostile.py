"""Images written by an attacker: digests that name host paths, layer
directories the store did not verify, sparse files and decompression bombs,
hostile configs, and a fuzzed layer applier.

Whatever an image says, no host directory may become one of its layers,
nothing may be written outside the layer being unpacked, and what is
refused leaves nothing behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from nsbox.errors import NsboxError
from nsbox.storage.archive import import_image
from nsbox.storage.resolve import resolve
from nsbox.storage.store import Session, Store

from tests.conftest import MODE
from tests.imagekit import Layout, Registry, add, busybox_layer, push, registry, run_image, store, tar_bytes  # noqa: F401

pytestmark = pytest.mark.timeout(90)


def _image(layout: Layout, layers: list[bytes], diff_ids: list[str] | None = None,
           config: dict[str, Any] | None = None, tag: str = "t") -> dict[str, Any]:
    """A one-image layout whose config may lie about its diff_ids."""
    descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layout.blob(gzip.compress(raw, mtime=0))}
             for raw in layers]
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids if diff_ids is not None else
                      ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in layers]}}
    cdesc = {"mediaType": "application/vnd.oci.image.config.v1+json", **layout.blob(json.dumps(cfg).encode())}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": cdesc, "layers": descs}
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
            **layout.blob(json.dumps(manifest).encode()), "platform": {"architecture": "amd64", "os": "linux"}}
    layout.tag(tag, desc)
    return desc


def _host_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_rsa").write_text("PRIVATE\n")
    os.chmod(tmp_path, 0o755)
    return secret


def _nothing_published(store: Store) -> None:
    assert store.records() == {}
    assert not list(store.tmp.iterdir())
    for key in store.layers_root.iterdir():
        assert list(key.iterdir()) == [], list(key.iterdir())


# ---- digests that name host paths ----------------------------------------

@pytest.mark.parametrize("form", ["absolute", "dotdot", "short"])
async def test_diff_id_naming_a_host_directory(tmp_path: Path, store: Store, form: str) -> None:
    secret = _host_secret(tmp_path)
    rel = os.path.relpath(secret, store.layers_root / MODE.key)
    evil = {"absolute": f"sha256:{secret}", "dotdot": f"sha256:{rel}", "short": "sha256:abcd"}[form]
    layout = Layout(tmp_path / "layout")
    raw = tar_bytes(lambda t: add(t, "f", b"x"))
    _image(layout, [busybox_layer(), raw], ["sha256:" + hashlib.sha256(busybox_layer()).hexdigest(), evil])
    with pytest.raises(NsboxError, match="invalid digest") as info:
        await import_image(store, layout.path, name="evil:1")
    assert "\n" not in str(info.value)
    assert (secret / "id_rsa").read_text() == "PRIVATE\n"
    _nothing_published(store)


async def test_pulled_diff_id_naming_a_host_directory(tmp_path: Path, store: Store, registry: Registry) -> None:
    secret = _host_secret(tmp_path)
    layout = Layout(tmp_path / "layout")
    raw = tar_bytes(lambda t: add(t, "f", b"x"))
    _image(layout, [busybox_layer(), raw], ["sha256:" + hashlib.sha256(busybox_layer()).hexdigest(),
                                            f"sha256:{secret}"], tag="evil")
    push(f"oci:{layout.path}:evil", registry, "hostile/diffid:1")
    with pytest.raises(NsboxError, match="invalid digest"):
        await resolve(store, f"{registry.host}/hostile/diffid:1")
    assert store.records() == {}


async def test_layout_digests_naming_paths(tmp_path: Path, store: Store) -> None:
    """Manifest, config and layer digests of a layout that are not digests."""
    secret = _host_secret(tmp_path)
    for i, field in enumerate(("manifest", "config", "layer")):
        layout = Layout(tmp_path / f"layout{i}")
        desc = _image(layout, [tar_bytes(lambda t: add(t, "f", b"x"))])
        manifest = json.loads((layout.path / "blobs/sha256" / desc["digest"][7:]).read_bytes())
        bad = f"sha256:{'0' * 60}/../../../../{secret}"
        if field == "manifest":
            desc = {**desc, "digest": bad}
        else:
            if field == "config":
                manifest["config"]["digest"] = bad
            else:
                manifest["layers"][0]["digest"] = bad
            desc = {**desc, **layout.blob(json.dumps(manifest).encode())}
        layout.index = []
        layout.tag("t", desc)
        with pytest.raises(NsboxError, match="invalid digest"):
            await import_image(store, layout.path, name=f"evil:{i}")
        _nothing_published(store)


async def test_layout_blob_larger_than_its_descriptor(tmp_path: Path, store: Store) -> None:
    """A blob file that does not end where its descriptor says (a 1 GiB
    sparse file here) is not copied whole into the store first."""
    layout = Layout(tmp_path / "layout")
    desc = _image(layout, [busybox_layer(), tar_bytes(lambda t: add(t, "f", b"x"))])
    manifest = json.loads((layout.path / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    blob = layout.path / "blobs/sha256" / manifest["layers"][1]["digest"][7:]
    with open(blob, "r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(NsboxError, match=r"larger than its \d+ bytes"):
        await import_image(store, layout.path, name="long:1")
    _nothing_published(store)
    os.unlink(blob)
    os.mkfifo(blob)
    with pytest.raises(NsboxError, match="not a regular file"):
        await import_image(store, layout.path, name="fifo:1")
    _nothing_published(store)


async def test_unverified_layer_directory_is_not_trusted(tmp_path: Path, store: Store) -> None:
    """A directory already at a layer's place, not unpacked and verified
    by the store, is replaced by the layer's real content."""
    raw = tar_bytes(lambda t: add(t, "real", b"from the image\n"))
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    planted = store.layers_root / MODE.key / diff_id[7:]
    planted.mkdir(parents=True)
    (planted / "planted").write_text("not from the image\n")
    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer(), raw])
    image = await import_image(store, layout.path, name="plant:1")
    top = image.layers[-1]
    assert sorted(p.name for p in top.iterdir()) == ["real"]
    # Verified once: the next use trusts it without unpacking again.
    again = await resolve(store, "plant:1")
    assert again.layers == image.layers and os.lstat(top).st_ino == os.lstat(again.layers[-1]).st_ino


@pytest.mark.parametrize("root", [{"mode": 0o555}, {"uid": 1000, "gid": 1000}])
async def test_a_layer_root_entry_is_not_applied(tmp_path: Path, store: Store, root: dict[str, int]) -> None:
    """A layer's "./" entry read-only, or another user's: the layer's root
    stays 0755 and sandbox root's (an overlay shows its upper dir's root
    anyway). Rootless, publishing the layer (a rename to another parent,
    which needs write permission on it) had failed with a PermissionError."""
    import stat

    raw = tar_bytes(lambda t: [add(t, "./", type=tarfile.DIRTYPE, **{"mode": 0o755, **root}),
                               add(t, "hello", b"hi\n")])
    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer(), raw])
    image = await import_image(store, layout.path, name="root:1")
    st = os.stat(image.layers[-1])
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o755, *MODE.host_root)
    assert (image.layers[-1] / "hello").read_bytes() == b"hi\n"


async def test_an_image_with_a_layer_twice_runs(tmp_path: Path, store: Store) -> None:
    """`RUN true` twice makes the same (empty) layer twice: overlayfs had
    refused its directory twice in lowerdir (ELOOP)."""
    layout = Layout(tmp_path / "layout")
    empty = bytes(1024)
    _image(layout, [busybox_layer(), empty, tar_bytes(lambda t: add(t, "f", b"x")), empty])
    image = await import_image(store, layout.path, name="dup:1")
    assert len(image.layers) == 4 and image.layers[1] == image.layers[3]
    async with run_image(image) as sb:
        r = await sb.exec(["cat", "/f"])
        assert r.success and r.stdout == "x", r.stderr


# ---- sparse files and bombs ----------------------------------------------

def _sparse_tar(tmp_path: Path, fmt: str, size: int = 1 << 30) -> bytes:
    src = tmp_path / f"sparse-{fmt}"
    src.mkdir()
    with open(src / "hole", "wb") as f:
        f.truncate(size)
        f.seek(100_000_000)
        f.write(b"data in the middle")
    out = tmp_path / f"sparse-{fmt}.tar"
    subprocess.run(["tar", "-S", f"--format={fmt}", "--numeric-owner", "-cf", out, "-C", src, "hole"], check=True)
    return out.read_bytes()


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
async def test_sparse_members_stay_sparse(tmp_path: Path, store: Store, fmt: str) -> None:
    raw = _sparse_tar(tmp_path, fmt)
    assert len(raw) < 64 << 10
    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer(), raw])
    image = await import_image(store, layout.path, name="sparse:1")
    st = os.stat(image.layers[-1] / "hole")
    assert st.st_size == 1 << 30
    assert st.st_blocks * 512 < 1 << 20  # a hole, not a GiB of zeros
    with open(image.layers[-1] / "hole", "rb") as f:
        f.seek(100_000_000)
        assert f.read(18) == b"data in the middle"
        f.seek(0)
        assert f.read(4096) == bytes(4096)


def _limited(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NSBOX_IMAGE_LIMITS", value)


async def test_gzip_bomb_refused(tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    zeros = bytes(64 << 20)
    raw = tar_bytes(lambda t: add(t, "bomb", zeros))
    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer(), raw])
    blob = gzip.compress(raw, mtime=0)
    assert len(blob) < 100 << 10
    _limited(monkeypatch, "layer-size=16M")
    with pytest.raises(NsboxError, match=r"more than 16 MiB.*NSBOX_IMAGE_LIMITS") as info:
        await import_image(store, layout.path, name="bomb:1")
    assert "\n" not in str(info.value)
    _nothing_published(store)
    # Raised, the same image imports.
    _limited(monkeypatch, "layer-size=80M")
    image = await import_image(store, layout.path, name="bomb:1")
    assert os.stat(image.layers[-1] / "bomb").st_size == 64 << 20


async def test_a_layer_done_as_its_image_is_refused_is_not_kept(tmp_path: Path, store: Store,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers unpack side by side: one that finishes unpacking just as another
    is refused used to be put in place after the refusal had removed what
    the image had published, and stayed."""
    from nsbox.storage.apply import Unpacker

    raw = tar_bytes(lambda t: add(t, "bomb", bytes(8 << 20)))
    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer(), raw])
    _limited(monkeypatch, "layer-size=4M")
    unpacked, refused = anyio.Event(), anyio.Event()
    real_refused, real_apply = Session._refused, Unpacker.apply
    bomb = "sha256:" + hashlib.sha256(gzip.compress(raw, mtime=0)).hexdigest()

    def _refused(self: Session, *args: Any) -> Any:
        refused.set()
        return real_refused(self, *args)

    async def apply(self: Unpacker, blob: str, *args: Any, **kwargs: Any) -> Any:
        if blob == bomb:  # refused once the other layer is unpacked
            await unpacked.wait()
            return await real_apply(self, blob, *args, **kwargs)
        report = await real_apply(self, blob, *args, **kwargs)
        unpacked.set()
        with anyio.CancelScope(shield=True):  # and that one returns only then
            await refused.wait()
        return report

    monkeypatch.setattr(Session, "_refused", _refused)
    monkeypatch.setattr(Unpacker, "apply", apply)
    with pytest.raises(NsboxError, match=f"layer {bomb[:19]} unpacks to more than 4 MiB"):
        await import_image(store, layout.path, name="late:1")
    _nothing_published(store)


@pytest.mark.parametrize("other", ["named", "being-named"])
async def test_a_refused_image_leaves_the_layers_another_image_uses(tmp_path: Path, store: Store, other: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile image shares a layer with a good one, imported meanwhile:
    its refusal took the layer from under the good image (and from under
    its sandboxes), named or about to be."""
    from nsbox.storage.apply import Unpacker

    raw = tar_bytes(lambda t: add(t, "bomb", bytes(8 << 20)))
    bomb = "sha256:" + hashlib.sha256(gzip.compress(raw, mtime=0)).hexdigest()
    hostile, good = Layout(tmp_path / "hostile"), Layout(tmp_path / "good")
    _image(hostile, [busybox_layer(), raw])
    _image(good, [busybox_layer()])
    shared = "sha256:" + hashlib.sha256(busybox_layer()).hexdigest()
    _limited(monkeypatch, "layer-size=4M")
    counted, refused = anyio.Event(), anyio.Event()
    real_apply, real_tag, real_refused = Unpacker.apply, Store.tag, Session._refused

    async def apply(self: Unpacker, blob: str, *args: Any, **kwargs: Any) -> Any:
        if blob == bomb:  # refused once the good image has the shared layer
            await counted.wait()
        return await real_apply(self, blob, *args, **kwargs)

    async def tag(self: Store, name: str, *args: Any, **kwargs: Any) -> Any:
        if name.endswith("good:1") and other == "being-named":
            counted.set()
            await refused.wait()
        return await real_tag(self, name, *args, **kwargs)

    def _refused(self: Session, *args: Any) -> Any:
        error = real_refused(self, *args)
        refused.set()
        return error

    monkeypatch.setattr(Unpacker, "apply", apply)
    monkeypatch.setattr(Store, "tag", tag)
    monkeypatch.setattr(Session, "_refused", _refused)
    failures: list[Exception] = []
    async with anyio.create_task_group() as tg:
        async def import_hostile() -> None:
            try:
                await import_image(store, hostile.path, name="hostile:1")
            except NsboxError as e:
                failures.append(e)

        tg.start_soon(import_hostile)
        while store.verified(shared, MODE.key) is None:  # the hostile import unpacked it
            await anyio.sleep(0.01)
        image = await import_image(store, good.path, name="good:1")
        counted.set()
    assert len(failures) == 1 and "more than 4 MiB" in str(failures[0])
    assert store.image(image.digest, name=image.name, key=MODE.key) is not None
    assert (image.layers[0] / "bin/busybox").is_file()


@pytest.mark.parametrize("shape", ["flat", "deep"])
async def test_too_many_members_refused(tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch,
                                        shape: str) -> None:
    def many(t: tarfile.TarFile) -> None:
        if shape == "flat":
            for i in range(3000):
                add(t, f"d/f{i}")
        else:  # one member whose name makes 3000 directories
            add(t, "/".join(["a"] * 3000) + "/f")

    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer(), tar_bytes(many)])
    _limited(monkeypatch, "layer-files=1000")
    with pytest.raises(NsboxError, match=r"more than 1000 files.*NSBOX_IMAGE_LIMITS"):
        await import_image(store, layout.path, name="many:1")
    _nothing_published(store)


async def test_image_size_bound(tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [tar_bytes(lambda t, i=i: add(t, f"f{i}", os.urandom(6 << 20))) for i in range(3)]
    layout = Layout(tmp_path / "layout")
    _image(layout, layers)
    _limited(monkeypatch, "layer-size=8M,size=16M")
    with pytest.raises(NsboxError, match=r"image .*more than 16 MiB.*NSBOX_IMAGE_LIMITS"):
        await import_image(store, layout.path, name="big:1")
    _nothing_published(store)


async def test_a_bound_used_up_leaves_the_next_layer_nothing(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the layers before it used up the image's bound exactly, the next
    layer may unpack nothing: its applier is given 0 and stops at its first
    member (0 had read as "no bound", so the layer unpacked in full first)."""
    from nsbox.storage.apply import Exceeded
    from nsbox.storage.bounds import Budget

    _limited(monkeypatch, "files=3")
    first = tar_bytes(lambda t: [add(t, f"f{i}", b"x") for i in range(3)])
    second = tar_bytes(lambda t: [add(t, f"g{i}", b"y") for i in range(200)])
    blobs = [store.put_bytes(raw) for raw in (first, second)]
    budget = Budget("bound:1")
    outcomes: list[tuple[Any, ...]] = []
    async with store.session() as s:
        real = s.unpacker.apply

        async def apply(blob: str, name: str, max_bytes: int, max_files: int, feed: Any = None) -> Any:
            try:
                report = await real(blob, name, max_bytes, max_files, feed=feed)
            except Exceeded:
                outcomes.append(("stopped", max_files))
                raise
            outcomes.append(("unpacked", max_files, report.entries))
            return report

        s.unpacker.apply = apply  # type: ignore[method-assign]
        await s.layer(blobs[0], None, budget)
        with pytest.raises(NsboxError, match=r"more than 3 files.*NSBOX_IMAGE_LIMITS"):
            await s.layer(blobs[1], None, budget)
    assert outcomes == [("unpacked", 3, 3), ("stopped", 0)]
    assert not list(store.tmp.iterdir())
    for key in store.layers_root.iterdir():
        assert list(key.iterdir()) == [], list(key.iterdir())


async def test_a_full_disk_at_the_layer_marker_leaves_no_layer(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker of an unpacked layer cannot be written (a full disk): no
    layer directory is left without it (it was renamed into place first),
    and once there is room the same layer unpacks and is marked."""
    import errno

    from nsbox.storage.bounds import Budget

    blob = store.put_bytes(tar_bytes(lambda t: add(t, "f", b"x")))
    real = store.temp_file

    def full(data: bytes) -> Path:
        if b'"diff_id"' in data:  # the marker
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(data)

    monkeypatch.setattr(store, "temp_file", full)
    async with store.session() as s:
        with pytest.raises(OSError, match="No space left"):
            await s.layer(blob, None, Budget("full:1"))
    assert [list(key.iterdir()) for key in store.layers_root.iterdir()] == [[]]
    assert not list(store.tmp.iterdir())
    monkeypatch.setattr(store, "temp_file", real)
    async with store.session() as s:
        diff_id, layer = await s.layer(blob, None, Budget("full:1"))
    assert store.verified(diff_id, MODE.key) is not None and (layer / "f").read_bytes() == b"x"


def _applier(tmp_path: Path, raw: bytes, nofile: int | None = None) -> subprocess.CompletedProcess[str]:
    """applytar.py run on `raw` in a process of its own, its descriptors
    bounded to `nofile` (a sandbox's limit may be as low)."""
    import resource
    import sys

    from nsbox.storage import applytar

    blob = tmp_path / "blob"
    blob.write_bytes(raw)
    args = json.dumps({"blob": str(blob), "dest": str(tmp_path / "dest"), "single": True})

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    return subprocess.run([sys.executable, "-I", applytar.__file__, args], capture_output=True, text=True,
                          timeout=60, preexec_fn=limit)


def test_a_member_deeper_than_the_descriptor_limit(tmp_path: Path) -> None:
    """A member 600 directories deep unpacks under a limit of 512
    descriptors: the walk keeps at most CACHED_DIRS of its directories open
    (it had kept all of them: EMFILE, reported as a resource limit)."""
    deep = "/".join(["d"] * 600)
    try:
        r = _applier(tmp_path, tar_bytes(lambda t: add(t, deep + "/f", b"deep")), nofile=512)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["entries"] == 601
        assert (tmp_path / "dest" / deep / "f").read_bytes() == b"deep"
    finally:  # not left to pytest's recursive removal of old temp directories
        subprocess.run(["rm", "-rf", str(tmp_path / "dest")], check=True, timeout=60)


def test_member_names_cannot_fake_the_error_line(tmp_path: Path) -> None:
    """The applier's error is one line whatever the member's name holds: a
    newline would fake the line the host parses (an errno, for a full
    disk), an escape sequence would reach the user's terminal."""
    name = "x" * 300 + "\n28 fake\x1b[31m"
    r = _applier(tmp_path, tar_bytes(lambda t: add(t, name, b"z")))
    assert r.returncode == 1, r.stderr  # the name is too long for the filesystem
    assert r.stderr.count("\n") == 1 and "\x1b" not in r.stderr, r.stderr
    assert r.stderr.startswith("x" * 300 + "\\n28 fake\\x1b[31m: "), r.stderr


def _huge_pax_header(size: int) -> bytes:
    """A layer whose one member has a PAX header of `size` bytes (one
    comment record), which gzip shrinks to a few KiB."""
    record = b" comment=" + b"z" * size + b"\n"
    length = len(record) + len(str(len(record) + 7))
    record = str(length).encode() + record
    assert len(record) == length
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, len(record)
    body = header.tobuf(tarfile.USTAR_FORMAT) + record + bytes(-len(record) % 512)
    return body + tar_bytes(lambda t: add(t, "f", b"data"))


def test_an_oversized_extended_header_is_refused_not_read(tmp_path: Path) -> None:
    """tarfile reads a PAX header whole: 64 MiB of it (64 KiB gzipped) is
    refused by the applier and by the builder's view of a layer, before
    being read; one of 64 KiB (an xattr's most) is read."""
    from nsbox.dockerfile.fsview import View

    r = _applier(tmp_path, _huge_pax_header(64 << 20))
    assert r.returncode == 3 and "an extended header of" in r.stderr, r.stderr
    blob = tmp_path / "layer.tar.gz"
    blob.write_bytes(gzip.compress(_huge_pax_header(64 << 20), mtime=0))
    with pytest.raises(NsboxError, match="an extended header of"):
        View().with_layer(blob)
    blob.write_bytes(gzip.compress(_huge_pax_header(64 << 10), mtime=0))
    assert View().with_layer(blob).get("f") is not None


def test_limits_setting_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from nsbox.storage.bounds import ImageBounds

    monkeypatch.setenv("NSBOX_IMAGE_LIMITS", "layer-size=2G, files=10k")
    lim = ImageBounds.from_env()
    assert lim.layer_size == 2 << 30 and lim.files == 10_000
    for bad in ("layer-size=lots", "colour=red", "size"):
        monkeypatch.setenv("NSBOX_IMAGE_LIMITS", bad)
        with pytest.raises(NsboxError, match="NSBOX_IMAGE_LIMITS"):
            ImageBounds.from_env()


# ---- the applier, fuzzed --------------------------------------------------

def _fuzz_members() -> Any:
    from hypothesis import strategies as st

    comp = st.sampled_from(["a", "b", "..", ".", "", "sentinel", "link", ".wh.a", ".wh..wh..opq", ".wh..", ".wh...",
                            ".wh.", "dir", "x" * 300])
    name = st.lists(comp, min_size=1, max_size=5).map("/".join) | st.lists(comp, min_size=1, max_size=4).map(
        lambda p: "/" + "/".join(p))
    link = name | st.sampled_from(["{sentinel}", "{sentinel}/file", "../sentinel", "../../sentinel/file", "/", ".."])
    kind = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE,
                            tarfile.CHRTYPE, tarfile.BLKTYPE, b"Z"])
    mode = st.integers(0, 0o177777)
    owner = st.integers(0, 70000)
    mtime = st.sampled_from([0, 1_700_000_000, -5, 2**40, 1e300])
    data = st.binary(max_size=64)
    return st.lists(st.tuples(name, kind, link, mode, owner, mtime, data), max_size=12)


def _fuzz_tar(members: list[Any], sentinel: Path) -> bytes:
    def build(t: tarfile.TarFile) -> None:
        for name, kind, link, mode, owner, mtime, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link.format(sentinel=sentinel)
            info.mode, info.uid, info.gid, info.mtime = mode & 0o7777, owner, owner, mtime
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            t.addfile(info, __import__("io").BytesIO(data) if info.size else None)
    return tar_bytes(build)


@pytest.mark.timeout(120)
def test_fuzzed_layers_stay_inside(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Hostile archives applied by the applier's own rules (run here, not
    in its sandbox: what the sandbox would contain must not be needed): a
    clear exit status or success, never an exception, never a write beside
    the target."""
    import shutil
    import tempfile

    from hypothesis import HealthCheck, given, settings

    from nsbox.storage import applytar

    from tests.imagekit import snapshot

    os.chmod(tmp_path, 0o755)
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "file").write_text("untouched\n")
    before = snapshot(sentinel)

    @settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_fuzz_members(), __import__("hypothesis").strategies.booleans())
    def check(members: list[Any], compressed: bool) -> None:
        work = Path(tempfile.mkdtemp(dir=tmp_path))
        try:
            blob = work / "blob"
            raw = _fuzz_tar(members, sentinel)
            blob.write_bytes(gzip.compress(raw) if compressed else raw)
            args = json.dumps({"blob": str(blob), "dest": str(work / "dest"), "single": True,
                               "max_bytes": 1 << 20, "max_files": 1000})
            rc = applytar.main(["applytar", args])
            err = capsys.readouterr().err
            assert rc in (0, 1, 3, 4), rc
            assert rc == 0 or err.strip().count("\n") == 0, err
            assert snapshot(sentinel) == before
            assert sorted(p.name for p in work.iterdir()) == ["blob", "dest"]
            assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("tmp")) == ["sentinel"]
        finally:
            for dirpath, dirs, _files in os.walk(work):
                for d in dirs:
                    if not os.path.islink(os.path.join(dirpath, d)):
                        os.chmod(os.path.join(dirpath, d), 0o700)
            shutil.rmtree(work)

    check()


# ---- configs and manifests -------------------------------------------------

@pytest.mark.parametrize("config", [{"Entrypoint": ["sh", 1]}, {"Env": ["A=\0B"]}, {"WorkingDir": {"x": 1}},
                                    {"User": ["root"]}, {"Cmd": {"a": "b"}}, {"Labels": ["x"]}])
async def test_hostile_config_values(tmp_path: Path, store: Store, config: dict[str, Any]) -> None:
    layout = Layout(tmp_path / "layout")
    _image(layout, [tar_bytes(lambda t: add(t, "f", b"x"))], config=config)
    with pytest.raises(NsboxError, match="the image config's .* is not") as info:
        await import_image(store, layout.path, name="config:1")
    assert "\n" not in str(info.value)
    _nothing_published(store)


async def test_a_base_image_with_onbuild_triggers_is_refused_by_a_build(tmp_path: Path, store: Store) -> None:
    """Docker runs them at the FROM; a build that skipped them would make
    another image than Docker's (they had been ignored)."""
    from nsbox.dockerfile import BuildError, build_image

    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer()], config={"OnBuild": ["RUN echo triggered > /t"]})
    await import_image(store, layout.path, name="localhost/onbuild:1")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/onbuild:1\nRUN true\n")
    with pytest.raises(BuildError, match=r"Dockerfile:1 \(FROM\): the base image localhost/onbuild:1 has ONBUILD "
                                         r"triggers \(RUN echo triggered > /t\), which nsbox build does not run"):
        await build_image(ctx, tag="localhost/child:1", store=store, network="none", progress=lambda _: None)


async def test_one_string_entrypoint_is_one_argument(tmp_path: Path, store: Store) -> None:
    layout = Layout(tmp_path / "layout")
    _image(layout, [busybox_layer()], config={"Entrypoint": "/bin/echo", "Cmd": "hi there"})
    image = await import_image(store, layout.path, name="str:1")
    assert image.config.command == ["/bin/echo", "hi there"]


async def test_too_many_layers(tmp_path: Path, store: Store) -> None:
    layout = Layout(tmp_path / "layout")
    _image(layout, [tar_bytes(lambda t, i=i: add(t, f"f{i}", b"x")) for i in range(129)])
    with pytest.raises(NsboxError, match="129 layers, more than the 128"):
        await import_image(store, layout.path, name="tall:1")
    _nothing_published(store)


def _put_blob(registry: Registry, repo: str, data: bytes) -> dict[str, Any]:
    import httpx

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    base = f"http://{registry.host}/v2/{repo}"
    r = httpx.post(f"{base}/blobs/uploads/")
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    location = location if location.startswith("http") else f"http://{registry.host}{location}"
    r = httpx.put(f"{location}{'&' if '?' in location else '?'}digest={digest}", content=data,
                  headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return {"digest": digest, "size": len(data)}


async def test_huge_config_from_a_registry(tmp_path: Path, store: Store, registry: Registry) -> None:
    """skopeo refuses to push a config over 4 MiB, so it goes over HTTP."""
    import httpx

    layer = gzip.compress(busybox_layer(), mtime=0)
    ldesc = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_put_blob(registry, "hostile/cfg", layer)}
    cfg = {"architecture": "amd64", "os": "linux", "config": {"Labels": {"junk": "x" * (5 << 20)}},
           "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(busybox_layer()).hexdigest()]}}
    cdesc = {"mediaType": "application/vnd.oci.image.config.v1+json",
             **_put_blob(registry, "hostile/cfg", json.dumps(cfg).encode())}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": cdesc, "layers": [ldesc]}
    r = httpx.put(f"http://{registry.host}/v2/hostile/cfg/manifests/1", content=json.dumps(manifest).encode(),
                  headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 201, r.text
    with pytest.raises(NsboxError, match="larger than"):
        await resolve(store, f"{registry.host}/hostile/cfg:1")
    assert store.records() == {}


async def test_nested_indexes_stop(tmp_path: Path, store: Store) -> None:
    layout = Layout(tmp_path / "layout")
    desc = _image(layout, [tar_bytes(lambda t: add(t, "f", b"x"))])
    for _ in range(5):
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [desc]}
        desc = {"mediaType": "application/vnd.oci.image.index.v1+json", **layout.blob(json.dumps(index).encode()),
                "platform": {"architecture": "amd64", "os": "linux"}}
    layout.index = []
    layout.tag("deep", desc)
    with pytest.raises(NsboxError, match="nest too deeply"):
        await import_image(store, layout.path, name="deep:1", platform="linux/amd64")
    _nothing_published(store)
