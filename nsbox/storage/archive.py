"""Importing images from files: all feed the same blob and layer store.

- a `docker save` / `podman save` archive (manifest.json; compressed too);
- an OCI image layout directory, or an oci-archive (that layout in a tar);
- a root filesystem tarball (.tar, .tar.gz, .tar.zst, .tar.xz): one layer;
- a directory holding a root filesystem: archived inside a sandbox (so its
  owners read back as sandbox ids), then imported as a one-layer image.

Archives are only read here, member by member, never extracted: the layer
applier does that, confined (see apply.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import anyio

from ..host import idmap
from ..errors import NsboxError
from ..spec import Bind
from . import oci
from .applytar import BoundedHeaders, shown
from .bounds import ImageBounds, refusal
from .config import ImageConfig
from .progress import Progress
from .reference import ReferenceError, parse
from .store import COPY_CHUNK, Image, Session, Store

REF_NAME = "org.opencontainers.image.ref.name"
_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ\x00": "xz", b"BZh": "bzip2"}
_ARCHIVE_TOP = re.compile(r"(manifest\.json|oci-layout|index\.json|repositories|blobs|[0-9a-f]{64}(\.json|\.tar)?)")
# Symlinks followed to reach a member (docker save links shared layers).
_MAX_LINKS = 8
# What a decompressed archive may hold beyond its image's bound: manifests,
# configs, tar headers.
_ARCHIVE_SLACK = 16 << 20


def compression(head: bytes) -> str | None:
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return kind
    return None


def layer_media_type(head: bytes) -> str:
    kind = compression(head)
    return oci.OCI_LAYER + {"gzip": "+gzip", "zstd": "+zstd", None: ""}.get(kind, "")


class _Files:
    """Named files of a layout or archive: a directory or a tar's members.
    `source`: the file or directory the user named (the tar may be a
    decompressed copy of it)."""

    def __init__(self, root: Path | tarfile.TarFile, source: Path | None = None) -> None:
        self.root = root
        self.source = source or (root if isinstance(root, Path) else Path(os.fsdecode(root.name or "image")))
        # A tar's members by normalised name, the last of a name winning (as extracting would).
        self.members = {} if isinstance(root, Path) else {_member_name(m.name): m for m in root.getmembers()}

    def exists(self, name: str) -> bool:
        if isinstance(self.root, Path):
            return (self.root / name).is_file()
        return _member_name(name) in self.members

    def member(self, name: str) -> tarfile.TarInfo:
        """The regular file `name` names, its symlinks and hardlinks followed
        here, a few at most (tarfile would follow a loop until RecursionError)."""
        for _ in range(_MAX_LINKS + 1):
            member = self.members.get(_member_name(name))
            if member is None:
                raise NsboxError(f"the archive has no file {shown(name)}")
            if member.isreg():
                return member
            if member.issym():
                name = posixpath.join(posixpath.dirname(_member_name(member.name)), member.linkname)
            elif member.islnk():
                name = member.linkname
            else:
                raise NsboxError(f"{shown(name)} in the archive is not a regular file")
        raise NsboxError(f"{shown(name)} in the archive: too many symlinks (a loop?)")

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if isinstance(self.root, Path):
            path = (self.root / name).resolve()
            if not path.is_relative_to(self.root.resolve()):
                raise NsboxError(f"{name} points outside the image layout")
            if not path.is_file():  # a FIFO or device would block or never end
                raise NsboxError(f"{name} in the image layout is not a regular file")
            with open(path, "rb") as f:
                yield f
            return
        member = self.root.extractfile(self.member(name))
        assert member is not None  # a regular file
        with member:
            yield member

    def read(self, name: str, limit: int = oci.MAX_MANIFEST) -> bytes:
        with self.open(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise NsboxError(f"{shown(name)} is too large for a manifest or config")
        return data


def _member_name(name: str) -> str:
    """A member's name as a path in the archive ("./a//b" is "a/b")."""
    return posixpath.normpath("/" + name).lstrip("/")


def _default_name(source: Path, tag: str = "latest") -> str:
    stem = source.name.lower()
    for ext in (".gz", ".tgz", ".zst", ".xz", ".bz2", ".tar", ".oci"):
        stem = stem.removesuffix(ext)
    stem = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("._-") or "image"
    return f"localhost/{stem}:{tag}"


def _normal(name: str) -> str:
    try:
        ref = parse(name)
    except ReferenceError as e:
        raise NsboxError(f"--name {name!r}: {e.message}") from None
    if ref.digest:
        raise NsboxError(f"--name {name!r}: a name with a digest is only for the image pulled by it",
                         hint="name it with a tag (NAME:TAG)")
    return str(ref)


async def import_image(store: Store, source: str | os.PathLike[str], *, name: str | None = None,
                       tag: str | None = None, platform: str | None = None, id_mapping: idmap.Requested = "auto",
                       progress: Progress | None = None) -> Image:
    """Imports `source` (see the module doc for the formats); `name` tags the
    result, `tag` picks one image of a layout or archive holding several."""
    src = Path(source).expanduser().absolute()
    progress = progress or Progress()
    if not src.exists():
        raise NsboxError(f"{src} does not exist")
    want = oci.Platform.parse(platform) if platform else oci.Platform.current()
    named = _normal(name) if name else None  # a bad name fails before any work
    async with store.session(id_mapping, progress) as s:
        if src.is_dir():
            if (src / "oci-layout").is_file():
                digest, names = await _from_layout(s, _Files(src), want, tag)
                kind = "oci"
            elif (src / "manifest.json").is_file():
                digest, names = await _from_docker(s, _Files(src), tag)
                kind = "docker-archive"
            else:
                digest, names = await _from_directory(s, src, want), []
                kind = "directory"
        else:
            digest, names, kind = await _from_file(s, src, want, tag)
        given = [named] if named else [n for n in map(_try_normal, names) if n] or [_default_name(src, tag or "latest")]
        image = await s.unpack_image(digest, name=given[0])
        for n in given:  # named only once complete
            await store.tag(n, digest, source=kind)
    return image


async def _from_file(s: Session, src: Path, want: oci.Platform, tag: str | None,
                     source: Path | None = None) -> tuple[str, list[str], str]:
    """`source`: the file the user named, when `src` is its decompressed copy."""
    with open(src, "rb") as f:
        head = f.read(6)
    kind = compression(head)
    if kind is None:
        with _open_tar(src, source or src) as files:
            if files.exists("manifest.json"):
                digest, tags = await _from_docker(s, files, tag)
                return digest, tags, "docker-archive"
            if files.exists("oci-layout") and files.exists("index.json"):
                digest, tags = await _from_layout(s, files, want, tag)
                return digest, tags, "oci-archive"
    elif _looks_like_image_archive(src, kind):
        # `docker save | gzip`: decompress once, then read it as a tar.
        tmp = s.store.temp_path()
        try:
            await anyio.to_thread.run_sync(_decompress, src, kind, tmp, ImageBounds.from_env())
            return await _from_file(s, tmp, want, tag, src)
        finally:
            tmp.unlink(missing_ok=True)
    return await _from_rootfs_tarball(s, src, want), [], "rootfs"


@contextlib.contextmanager
def _open_tar(src: Path, source: Path) -> Iterator[_Files]:
    """The members of an uncompressed tar, its extended headers bounded
    (tarfile reads one whole: a 1 GiB PAX header would be 1 GiB here)."""
    try:
        with tarfile.open(src, "r:", tarinfo=BoundedHeaders) as tf:
            yield _Files(tf, source)
    except tarfile.TarError as e:
        raise NsboxError(f"{source} is not a tar archive nsbox reads ({e})") from None


def _decompressor(kind: str, src: Path) -> subprocess.Popen[bytes]:
    prog = {"gzip": ["gzip", "-dc"], "zstd": ["zstd", "-dcq"], "xz": ["xz", "-dc"], "bzip2": ["bzip2", "-dc"]}[kind]
    try:
        return subprocess.Popen([*prog, "--", os.fspath(src)], stdout=subprocess.PIPE)
    except FileNotFoundError:
        raise NsboxError(f"{src} is {kind}-compressed and {prog[0]} is not installed") from None


def _looks_like_image_archive(src: Path, kind: str) -> bool:
    """Whether the first member of a compressed tar is an image archive's."""
    proc = _decompressor(kind, src)
    assert proc.stdout is not None
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|", tarinfo=BoundedHeaders) as tf:
            first = tf.next()
            return first is not None and bool(_ARCHIVE_TOP.fullmatch(first.name.lstrip("./").split("/")[0]))
    except tarfile.TarError:
        return False
    finally:
        proc.kill()
        proc.wait()


def _decompress(src: Path, kind: str, dest: Path, bounds: ImageBounds) -> None:
    """Decompresses `src` into `dest`, at most the image's bound (plus room
    for its manifests and configs): a few KiB of zstd can say 1 TiB of zeros."""
    limit = bounds.size + _ARCHIVE_SLACK
    proc = _decompressor(kind, src)
    assert proc.stdout is not None
    written = 0
    try:
        with open(dest, "wb") as out:
            while chunk := proc.stdout.read(COPY_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise refusal(f"archive {shown(src.name)}", "size", bounds.size)
                out.write(chunk)
        if proc.wait() != 0:
            raise NsboxError(f"{src}: {kind} decompression failed (corrupt or truncated)")
    finally:
        proc.kill()  # stopped early: the rest is not decompressed
        proc.wait()
        proc.stdout.close()


async def _put(s: Session, files: _Files, name: str, expected: str | None = None, size: int | None = None) -> str:
    def copy() -> str:
        with files.open(name) as f:
            return s.store.put_stream(f, expected, size)[0]
    return await anyio.to_thread.run_sync(copy)


# ---- docker save ------------------------------------------------------

async def _from_docker(s: Session, files: _Files, tag: str | None) -> tuple[str, list[str]]:
    entries = oci.json_doc(files.read("manifest.json"), "the archive's manifest.json")
    if not entries:
        raise NsboxError("the archive's manifest.json lists no image")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("Config"), str) and isinstance(e.get("Layers"), list)
            and all(isinstance(p, str) for p in e["Layers"]) and len(e["Layers"]) <= oci.MAX_LAYERS
            for e in entries):
        raise NsboxError("the archive's manifest.json is not a list of images with a Config and Layers")
    entry = entries[0]
    if tag:
        wanted = _normal(tag) if ":" in tag or "/" in tag else None
        matches = [e for e in entries if any((_try_normal(t) == wanted) if wanted else t.endswith(f":{tag}")
                                             for t in e.get("RepoTags") or [])]
        if not matches:
            raise NsboxError(f"the archive has no image tagged {tag}")
        entry = matches[0]
    elif len(entries) > 1:
        s.progress.note(shown(f"the archive holds {len(entries)} images; importing the first "
                              f"({', '.join(map(str, entry.get('RepoTags') or ['untagged']))})"))
    config_bytes = files.read(entry["Config"], oci.MAX_CONFIG)
    cfg = ImageConfig.parse(oci.json_object(config_bytes, "the image config"))
    config_digest = s.store.put_bytes(config_bytes)
    if len(cfg.diff_ids) != len(entry["Layers"]):
        raise NsboxError(f"manifest.json lists {len(entry['Layers'])} layers, the config {len(cfg.diff_ids)}")
    layers = []
    for path in entry["Layers"]:
        digest = await _put(s, files, path)
        with open(s.store.blob_path(digest), "rb") as f:
            head = f.read(6)
        layers.append((digest, s.store.blob_path(digest).stat().st_size, layer_media_type(head)))
    manifest = oci.manifest_doc((config_digest, len(config_bytes)), layers)
    return s.store.put_bytes(manifest), list(entry.get("RepoTags") or [])


# ---- OCI layouts ------------------------------------------------------

def _blob_name(digest: object) -> str:
    algo, hexd = oci.check_digest(digest, "the image layout")
    return f"blobs/{algo}/{hexd}"


async def _from_layout(s: Session, files: _Files, want: oci.Platform, tag: str | None) -> tuple[str, list[str]]:
    index = oci.json_object(files.read("index.json"), "index.json")
    manifests = index.get("manifests") or []
    if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
        raise NsboxError("the layout's index.json does not list descriptors")
    if tag:
        manifests = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) in (tag, _try_normal(tag))]
        if not manifests:
            raise NsboxError(f"the layout has no image named {tag}")
    if not manifests:
        raise NsboxError("the layout's index.json lists no image")
    names = sorted({n for m in manifests if (n := (m.get("annotations") or {}).get(REF_NAME))})
    desc = manifests[0]
    if len(manifests) > 1:
        if not all(oci.media_type({}, m.get("mediaType")) in oci.MANIFEST_TYPES and "platform" in m
                   for m in manifests):
            raise NsboxError(f"the layout holds {len(manifests)} images ({', '.join(names) or 'unnamed'})",
                             hint="pick one with --tag")
        desc = oci.select_manifest({"manifests": manifests}, want)
    for _ in range(4):  # an index may point at another index
        data = files.read(_blob_name(desc.get("digest")))
        oci.verify(data, desc["digest"], f"manifest {desc['digest']}")
        doc = oci.json_object(data, f"manifest {desc['digest']}")
        if oci.media_type(doc, desc.get("mediaType")) not in oci.INDEX_TYPES:
            break
        desc = oci.select_manifest(doc, want)
    else:
        raise NsboxError("the layout's indexes nest too deeply")
    layers = oci.layer_descriptors(doc)
    cdesc = oci.check_descriptor(doc.get("config"), f"manifest {desc['digest']}", sized=True)
    if int(cdesc["size"]) > oci.MAX_CONFIG:  # read whole later: bounded as a pull bounds it
        raise NsboxError(f"the config {cdesc['digest']} is larger than {oci.MAX_CONFIG} bytes")
    s.store.put_bytes(data)
    await _put(s, files, _blob_name(cdesc["digest"]), cdesc["digest"], int(cdesc["size"]))
    for d in layers:
        await _put(s, files, _blob_name(d["digest"]), d["digest"], int(d["size"]))
    # A ref.name is a tag ("latest") or a whole reference.
    tags = [f"localhost/{_layout_stem(files)}:{n}" if _valid_tag(n) else _try_normal(n) for n in names]
    return desc["digest"], [t for t in tags if t]


def _try_normal(name: str) -> str | None:
    """An archive's name for its image, normalised; None for one that is not
    a name, or carries a digest (only a pull by that digest may)."""
    try:
        ref = parse(name)
    except ReferenceError:
        return None
    return None if ref.digest else str(ref)


def _valid_tag(tag: str) -> bool:
    return bool(re.fullmatch(r"[\w][\w.-]{0,127}", tag))


def _layout_stem(files: _Files) -> str:
    return _default_name(files.source).split("/", 1)[1].rsplit(":", 1)[0]


# ---- root filesystems ---------------------------------------------------

async def _from_rootfs_tarball(s: Session, src: Path, want: oci.Platform) -> str:
    def copy() -> str:
        with open(src, "rb") as f:
            return s.store.put_stream(f)[0]
    blob = await anyio.to_thread.run_sync(copy)
    return await _one_layer_image(s, blob, want)


async def _one_layer_image(s: Session, blob: str, want: oci.Platform) -> str:
    diff_id, _ = await s.layer(blob, None)
    config = oci.config_doc([diff_id], want)
    config_digest = s.store.put_bytes(config)
    path = s.store.blob_path(blob)
    with open(path, "rb") as f:
        head = f.read(6)
    manifest = oci.manifest_doc((config_digest, len(config)), [(blob, path.stat().st_size, layer_media_type(head))])
    return s.store.put_bytes(manifest)


async def _from_directory(s: Session, src: Path, want: oci.Platform) -> str:
    """Archives the directory inside a sandbox with the owner's mapping (so
    owners come out as sandbox ids; made by the store's runner), then
    imports that tar."""
    name = f"dir-{os.urandom(6).hex()}.tar"
    out = s.staging / name
    box = s.store.confined([Bind(os.fspath(src), "/src", readonly=True), Bind(os.fspath(s.staging), "/out")],
                           id_mapping="single" if s.mapping.mode == "single" else "auto", label="nsbox image import")
    try:
        async with box:
            r = await box.exec(["tar", "--format=posix", "--numeric-owner", "--sort=name", "-C", "/src",
                                "-cf", f"/out/{name}", "."])
            if not r.success:
                raise NsboxError(f"archiving {src} failed: {r.stderr.strip()[-1000:]}")
        blob = await anyio.to_thread.run_sync(_adopt, s.store, out)
    finally:
        out.unlink(missing_ok=True)
    return await _one_layer_image(s, blob, want)


def _adopt(store: Store, path: Path) -> str:
    """Moves a file on the store's filesystem into the blobs (by digest)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    if store.has_blob(digest):
        path.unlink()
    else:
        tmp = store.temp_path()
        os.rename(path, tmp)
        store.commit_blob(tmp, digest)
    return digest

