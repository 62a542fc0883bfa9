"""The image store: blobs by digest, layers unpacked once per id mapping, names.

Under $XDG_DATA_HOME/nsbox/images:

    blobs/sha256/HEX        manifests, configs, layer archives (verified when written)
    layers/KEY/HEX          a layer unpacked for id mapping KEY, HEX its diff_id
    layers/KEY/HEX.verified written once HEX was unpacked here and its tar
                            stream hashed to the diff_id: only then is HEX used
    layers/KEY/.staging-*   unpacking in progress (bound into the unpack sandbox)
    tmp/                    downloads in progress (same filesystem: rename publishes)
    locks/                  flock files
    in-use/ID.json          the layers live sandbox ID stacks (host/stacked.py)
    refs.json               name -> {digest (manifest), id (config), ...}
    store.lock              shared by every pull/import, exclusive for prune and rm

An image's sandbox stacks its layer directories as overlay lower dirs:
nothing is copied per sandbox. Layers are keyed by diff_id (the digest of
the uncompressed tar) so images share them whatever the compression, and by
the id mapping because the files' host owners differ per mapping.

Every digest an image gives is checked to be one (oci.check_digest) before
it becomes a path, and a layer directory without its marker is unpacked
again, never used as it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc

from ..host import idmap
from ..host.dirs import data_dir
from ..errors import NsboxError
from ..spec import Bind
from . import oci
from .apply import ApplyReport, CorruptLayer, Exceeded, Feed, Unpacker
from .config import ImageConfig
from .confined import Confined, Runner
from .bounds import Budget, TooLarge
from .progress import Progress
from .reference import ReferenceError, parse
from ..host import stacked
from .uses import Counted, acquire

IMAGE_ID = re.compile(r"(?:sha256:)?([0-9a-f]{4,64})")
COPY_CHUNK = 1 << 20
SMALL_BLOB_MAX = max(oci.MAX_MANIFEST, oci.MAX_CONFIG)  # what read_blob reads whole
MARK = ".verified"


class ImageNotFound(NsboxError):
    pass


@dataclass(frozen=True)
class Image:
    """An image ready to run: its layers unpacked for `mapping`."""

    name: str | None  # the normalised reference it was found by (None: by id)
    digest: str  # of the manifest
    id: str  # of the config (Docker's IMAGE ID)
    config: ImageConfig
    layers: tuple[Path, ...]  # unpacked layer directories, lowest first
    mapping_key: str

    @property
    def lowerdirs(self) -> list[Path]:
        """overlayfs order: topmost first, each layer once (see ImageRootfs.lower_dirs)."""
        return list(dict.fromkeys(reversed(self.layers)))


@dataclass(frozen=True)
class Record:
    name: str
    digest: str
    id: str
    created: float  # when it was stored here
    size: int  # compressed layer bytes
    source: str  # "registry", "docker-archive", "oci", "rootfs"...
    platform: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "id": self.id, "created": self.created,
                "size": self.size, "source": self.source, "platform": self.platform}


@dataclass
class PruneReport:
    blobs: int = 0
    layers: int = 0
    bytes: int = 0


# Per process: store roots whose directories exist; blobs read and verified
# (small ones: manifests, configs), and the names last read, each with the
# file's identity when read.
_made: set[Path] = set()
_verified: dict[Path, tuple[tuple[int, int, int], bytes]] = {}
_VERIFIED_MAX = 512
_VERIFIED_MAX_BYTES = 1 << 20
# refs.json as last read, by its file identity: the names, and the same
# records by image id (a compose service's sandbox names its image by id).
_records: dict[Path, tuple[tuple[int, int, int], dict[str, "Record"], dict[str, "Record"]]] = {}


def _file_id(path: Path) -> tuple[int, int, int]:
    """What changes when a file is replaced or rewritten: inode, size, mtime."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class Store:
    """This user's images. `runner` makes the sandbox layers are unpacked in
    (storage/confined.py): a store without one reads, names and prunes, but
    cannot pull or import."""

    def __init__(self, root: Path | None = None, *, runner: Runner | None = None) -> None:
        self.root = Path(root) if root is not None else data_dir() / "images"
        self.runner = runner
        self.blobs = self.root / "blobs"
        self.layers_root = self.root / "layers"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"
        self.refs_file = self.root / "refs.json"
        if not (self.root in _made and os.path.isdir(self.tmp)):
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            for d in (self.tmp, self.locks, self.layers_root):
                d.mkdir(mode=0o700, exist_ok=True)
            # The unpack sandbox reads blobs through a bind: as another uid in root mode.
            (self.blobs / "sha256").mkdir(mode=0o755, parents=True, exist_ok=True)
            _made.add(self.root)

    # ---- locks -------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lock(self, name: str, shared: bool = False) -> AsyncIterator[None]:
        """flock on a lock file; polled so a waiting task can be cancelled."""
        path = self.root / "store.lock" if name == "store" else self.locks / f"{name}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            await acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ---- blobs -------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        algo, hexd = oci.check_digest(digest, "a blob descriptor")
        return self.blobs / algo / hexd

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def read_blob(self, digest: str) -> bytes:
        """A small blob (manifest, config), verified when it is read: again
        only if the file changed since (another inode, size or mtime)."""
        path = self.blob_path(digest)
        try:
            ident = _file_id(path)
            seen = _verified.get(path)
            if seen is not None and seen[0] == ident:
                return seen[1]
            with open(path, "rb") as f:
                data = f.read(SMALL_BLOB_MAX + 1)
        except FileNotFoundError:
            raise ImageNotFound(f"blob {digest} is missing from the store",
                                hint="pull or import the image again") from None
        if len(data) > SMALL_BLOB_MAX:
            raise NsboxError(f"stored blob {digest} is larger than a manifest or config may be "
                             f"({SMALL_BLOB_MAX} bytes)", hint="the image is damaged or hostile")
        oci.verify(data, digest, f"stored blob {digest}")
        if len(data) <= _VERIFIED_MAX_BYTES:
            if len(_verified) >= _VERIFIED_MAX:
                _verified.clear()
            _verified[path] = (ident, data)
        return data

    def read_json(self, digest: str) -> dict[str, Any]:
        return oci.json_object(self.read_blob(digest), f"stored blob {digest}")

    def temp_path(self) -> Path:
        return self.tmp / f"{os.getpid()}-{secrets.token_hex(6)}"

    def temp_file(self, data: bytes) -> Path:
        """A new temp file holding `data`; none is left if writing it fails
        (a full disk)."""
        tmp = self.temp_path()
        try:
            tmp.write_bytes(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def commit_blob(self, tmp: Path, digest: str) -> Path:
        """Publishes a verified temp file as blob `digest` (atomic rename)."""
        final = self.blob_path(digest)
        final.parent.mkdir(mode=0o755, exist_ok=True)
        os.chmod(tmp, 0o644)
        os.rename(tmp, final)
        return final

    def put_bytes(self, data: bytes) -> str:
        digest = oci.digest_of(data)
        if not self.has_blob(digest):
            self.commit_blob(self.temp_file(data), digest)
        return digest

    def put_stream(self, src: IO[bytes], expected: str | None = None, size: int | None = None) -> tuple[str, int]:
        """Copies a file object into the store, hashing it; checks `expected`
        and `size` when given. Blocking: run it in a thread."""
        h = oci.hasher(expected) if expected else hashlib.sha256()
        algo = expected.split(":")[0] if expected else "sha256"
        tmp = self.temp_path()
        n = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := src.read(COPY_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
                    if size is not None and n > size:  # stop now: the source may be endless
                        raise oci.DigestMismatch(f"blob {expected or 'content'} is larger than its {size} bytes")
            digest = f"{algo}:{h.hexdigest()}"
            if size is not None and n != size:
                raise oci.DigestMismatch(f"blob {expected or digest} has {n} bytes, not {size} (truncated?)")
            if expected and digest != expected:
                raise oci.DigestMismatch(f"blob content does not match its digest {expected} (got {digest})",
                                         hint="the source is damaged or tampered with")
            if self.has_blob(digest):
                tmp.unlink()
            else:
                self.commit_blob(tmp, digest)
            return digest, n
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # ---- layers ------------------------------------------------------

    def layer_dir(self, diff_id: str, key: str) -> Path:
        return self.layers_root / key / oci.check_digest(diff_id, "a layer's diff_id")[1]

    def verified(self, diff_id: str, key: str) -> dict[str, Any] | None:
        """What the marker of layer `diff_id` says, if the layer was unpacked
        and verified here (a directory, not a symlink); else None."""
        layer = self.layer_dir(diff_id, key)
        try:
            if not stat.S_ISDIR(os.lstat(layer).st_mode):
                return None
            fd = os.open(_marker(layer), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as f:
                info = json.loads(f.read(4096))
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("diff_id") == diff_id else None

    def _marker_file(self, report: ApplyReport) -> Path:
        """A temp file holding the marker of an unpacked layer (_publish
        renames it into place)."""
        info = {"diff_id": report.diff_id, "size": report.size, "entries": report.entries}
        return self.temp_file(json.dumps(info).encode())

    def _unpublish(self, layer: Path, mapping: idmap.IdMap | None) -> None:
        """Removes a layer directory, its marker first (so a crash between
        the two leaves a directory that is not trusted)."""
        _marker(layer).unlink(missing_ok=True)
        _remove(layer, mapping)

    @contextlib.asynccontextmanager
    async def session(self, id_mapping: idmap.Requested = "auto",
                      progress: Progress | None = None) -> AsyncIterator[Session]:
        """What one pull or import holds: the shared store lock, a staging
        directory and (started on first use) the unpack sandbox."""
        mapping = idmap.detect(id_mapping)
        async with self.lock("store", shared=True):
            base = self.layers_root / mapping.key
            base.mkdir(mode=0o700, exist_ok=True)
            staging = base / f".staging-{os.getpid()}-{secrets.token_hex(4)}"
            staging.mkdir(mode=0o700)
            if mapping.host_root != (os.geteuid(), os.getegid()):
                os.chown(staging, *mapping.host_root)  # sandbox root writes there
            counted = Counted(self.locks)
            try:
                async with Unpacker(self.blobs, staging, mapping, self.confined, id_mapping) as unpacker:
                    yield Session(self, mapping, staging, unpacker, progress or Progress(), counted)
            finally:
                counted.close()
                _remove(staging, mapping)

    def confined(self, binds: Sequence[Bind], *, id_mapping: idmap.Requested, label: str = "") -> Confined:
        """A sandbox to unpack in, made by the store's runner."""
        if self.runner is None:
            raise RuntimeError("this image store was made without a runner (storage/confined.py): "
                               "it cannot pull or import")
        return self.runner(binds, id_mapping=id_mapping, label=label)

    # ---- names -------------------------------------------------------

    def records(self) -> dict[str, Record]:
        """The names, as last written (refs.json is replaced by a rename:
        an unchanged inode, size and mtime mean unchanged names)."""
        return dict(self._read_records()[0])

    def _read_records(self) -> tuple[dict[str, Record], dict[str, Record]]:
        """The names and the ids (the last name of each), shared: not to be changed."""
        try:
            ident = _file_id(self.refs_file)
            seen = _records.get(self.refs_file)
            if seen is not None and seen[0] == ident:
                return seen[1], seen[2]
            raw = json.loads(self.refs_file.read_text())
        except FileNotFoundError:
            return {}, {}
        records = {name: Record(**{"name": name, **r}) for name, r in raw.items()}
        by_id = {r.id: r for r in records.values()}
        _records[self.refs_file] = (ident, records, by_id)
        return records, by_id

    async def tag(self, name: str, digest: str, *, source: str, pinned: bool = False) -> Record:
        """Names the image whose manifest is `digest`. A name with a digest
        (`python@sha256:...`) is only for what was pulled by it (`pinned`:
        the registry's answer matched it): given to a build or an archive,
        it would serve that content to whoever pins the real image."""
        try:
            named_digest = parse(name).digest
        except ReferenceError as e:
            raise NsboxError(f"invalid image name {name!r}: {e.message}") from None
        if named_digest is not None and not (pinned or named_digest == digest):
            raise NsboxError(f"cannot name an image {name}: a name with a digest is only for the image pulled "
                             "by that digest", hint="name it with a tag (NAME:TAG) instead")
        manifest = self.read_json(digest)
        config_digest = manifest["config"]["digest"]
        cfg = ImageConfig.parse(self.read_json(config_digest))
        size = sum(int(d.get("size", 0)) for d in oci.layer_descriptors(manifest))
        plat = f"{cfg.os}/{cfg.architecture}" + (f"/{cfg.variant}" if cfg.variant else "")
        rec = Record(name, digest, config_digest, time.time(), size, source, plat)
        async with self.lock("refs"):
            records = self.records()
            records[name] = rec
            self._write_records(records)
        return rec

    def _write_records(self, records: dict[str, Record]) -> None:
        data = {n: {k: v for k, v in r.to_dict().items() if k != "name"} for n, r in sorted(records.items())}
        os.rename(self.temp_file(json.dumps(data, indent=1).encode()), self.refs_file)
        # The new file may reuse the old one's inode within one mtime tick.
        _records.pop(self.refs_file, None)

    def lookup(self, ref: str) -> Record:
        """A stored image by name (normalised as Docker does) or by id prefix."""
        return self._lookup(ref)[0]

    def _lookup(self, ref: str) -> tuple[Record, bool]:
        """(record, whether `ref` named it by id)."""
        records, by_id = self._read_records()
        m = IMAGE_ID.fullmatch(ref)
        if m:
            prefix = m.group(1)
            # A whole id is looked up, not searched for.
            whole = by_id.get(f"sha256:{prefix}") if len(prefix) == 64 else None
            hits = {whole.id: whole} if whole is not None else {
                r.id: r for r in by_id.values() if r.id.split(":")[1].startswith(prefix)}
            if len(hits) == 1:
                return next(iter(hits.values())), True
            if len(hits) > 1:
                raise NsboxError(f"image id {ref} is ambiguous", hint="give more of it")
        try:
            name = str(parse(ref))
        except ReferenceError:
            if m:
                raise ImageNotFound(f"no image with id {ref}") from None
            raise
        if name in records:
            return records[name], False
        raise ImageNotFound(f"image {ref} is not in the store", hint=f"pull it: nsbox image pull {ref}")

    def inspect(self, ref: str) -> dict[str, Any]:
        rec = self.lookup(ref)
        manifest = self.read_json(rec.digest)
        cfg = ImageConfig.parse(self.read_json(rec.id))
        names = sorted(n for n, r in self.records().items() if r.id == rec.id)
        key = idmap.detect().key
        layers = [{"digest": d["digest"], "size": d.get("size"), "mediaType": d.get("mediaType"), "diff_id": diff,
                   "unpacked": os.fspath(self.layer_dir(diff, key)) if self.verified(diff, key) else None}
                  for d, diff in zip(oci.layer_descriptors(manifest), cfg.diff_ids)]
        return {**rec.to_dict(), "names": names, "config": cfg.to_dict(), "layers": layers}

    async def remove(self, ref: str) -> list[str]:
        """Forgets a name; an id forgets every name of that image. The
        content goes with the next prune."""
        rec, by_id = self._lookup(ref)
        async with self.lock("refs"):
            records = self.records()
            gone = [n for n, r in records.items() if (r.id == rec.id if by_id else n == rec.name)]
            for n in gone:
                del records[n]
            self._write_records(records)
        return gone

    # ---- resolving ---------------------------------------------------

    async def unpacked(self, rec: Record, *, id_mapping: idmap.Requested = "auto",
                       progress: Progress | None = None) -> Image:
        """The stored image `rec` with its layers unpacked for this user's id
        mapping (now, if they were not yet). Pulling what the store lacks is
        storage/resolve.py's."""
        image = self.image(rec.digest, name=rec.name, key=idmap.detect(id_mapping).key)
        if image is not None:
            return image
        async with self.session(id_mapping, progress) as s:
            return await s.unpack_image(rec.digest, name=rec.name)

    def image(self, digest: str, *, name: str | None, key: str) -> Image | None:
        """The image if all its layers are unpacked for id mapping `key`, else None."""
        manifest = self.read_json(digest)
        cfg = ImageConfig.parse(self.read_json(manifest["config"]["digest"]))
        if not all(self.verified(d, key) for d in cfg.diff_ids):
            return None
        layers = tuple(self.layer_dir(d, key) for d in cfg.diff_ids)
        return Image(name, digest, manifest["config"]["digest"], cfg, layers, key)

    # ---- prune -------------------------------------------------------

    def named_layers(self) -> set[str]:
        """The diff_ids (hex) of the layers of named images."""
        diffs: set[str] = set()
        for rec in self.records().values():
            with contextlib.suppress(NsboxError, KeyError, ValueError):
                diffs |= {d.split(":")[1] for d in ImageConfig.parse(self.read_json(rec.id)).diff_ids}
        return diffs

    async def prune(self) -> PruneReport:
        """Deletes blobs and unpacked layers no named image uses, and layer
        directories no live sandbox stacks (host/stacked.py), plus what interrupted
        pulls left."""
        report = PruneReport()
        async with self.lock("store"):
            keep_blobs: set[str] = set()
            for rec in self.records().values():
                with contextlib.suppress(NsboxError, KeyError, ValueError):
                    manifest = self.read_json(rec.digest)
                    keep_blobs |= {rec.digest, rec.id, *(d["digest"] for d in manifest.get("layers", []))}
            keep_diffs = self.named_layers()
            busy = stacked.layers_in_use(self.root)
            for algo_dir in self.blobs.iterdir():
                for blob in algo_dir.iterdir():
                    if f"{algo_dir.name}:{blob.name}" not in keep_blobs:
                        report.bytes += blob.stat().st_size
                        blob.unlink()
                        report.blobs += 1
            mapping = idmap.detect()
            for key_dir in self.layers_root.iterdir():
                for layer in key_dir.iterdir():
                    if layer.name.endswith(MARK):
                        continue
                    if layer.name.startswith(".staging-") or (
                            layer.name not in keep_diffs and os.path.realpath(layer) not in busy):
                        try:
                            self._unpublish(layer, mapping if key_dir.name == mapping.key else None)
                        except PermissionError:
                            continue  # another mapping's files: prune as that user
                        report.layers += not layer.name.startswith(".")
                for marker in key_dir.glob(f"*{MARK}"):
                    if not os.path.lexists(marker.with_name(marker.name[:-len(MARK)])):
                        marker.unlink()
                with contextlib.suppress(OSError):
                    key_dir.rmdir()
            # Not refs.lock: `image rm` takes it outside the store lock, and
            # two holders of two files of that name would not exclude each other.
            for leftover in (*self.tmp.iterdir(), *self.locks.iterdir()):
                if leftover != self.locks / "refs.lock":
                    leftover.unlink()
        return report


class Session:
    """One pull or import: unpacks layers, shares work through per-layer locks."""

    def __init__(self, store: Store, mapping: idmap.IdMap, staging: Path, unpacker: Unpacker,
                 progress: Progress, counted: Counted) -> None:
        self.store = store
        self.mapping = mapping
        self.staging = staging
        self.unpacker = unpacker
        self.progress = progress
        self.counted = counted  # held until the session ends, its images named

    async def layer(self, blob: str, diff_id: str | None, budget: Budget | None = None,
                    feed: Feed | None = None) -> tuple[str, Path]:
        """Unpacks blob into its layer directory unless there already is a
        verified one; returns (diff_id, directory). diff_id None: learn it
        by unpacking. `budget`: the image's bounds, shared by its layers.
        `feed`: the blob is not in the store yet, feed streams it (and
        stores it once verified; see Unpacker.apply); not called when the
        layer is there already."""
        key = self.mapping.key
        budget = budget or Budget(blob[:19])
        if diff_id:
            final = self.store.layer_dir(diff_id, key)
            await self.counted.hold(final, budget)
            if (info := self.store.verified(diff_id, key)) is None:
                async with self.store.lock(f"layer-{key}-{final.name}"):
                    if (info := self.store.verified(diff_id, key)) is None:
                        report, tmp = await self._unpack(blob, budget, feed)
                        if report.diff_id != diff_id:
                            _remove(tmp, self.mapping)
                            raise CorruptLayer(f"layer {blob} unpacks to {report.diff_id}, but the image config "
                                               f"says {diff_id}", hint="the image is damaged or tampered with")
                        self._publish(tmp, final, report, budget)
                        return diff_id, final
            self._count(final, info, budget)
            return diff_id, final
        report, tmp = await self._unpack(blob, budget, feed)
        final = self.store.layer_dir(report.diff_id, key)
        try:
            await self.counted.hold(final, budget)
        except BaseException:
            _remove(tmp, self.mapping)
            raise
        async with self.store.lock(f"layer-{key}-{final.name}"):
            if (info := self.store.verified(report.diff_id, key)) is not None:
                _remove(tmp, self.mapping)
                self._count(final, info, budget)
            else:
                self._publish(tmp, final, report, budget)
        return report.diff_id, final

    def _publish(self, tmp: Path, final: Path, report: ApplyReport, budget: Budget) -> None:
        """Renames a verified unpack into place (replacing what is there
        unverified: a crash's leftover or not ours), then marks it. Not
        once the image is refused: a layer unpacked side by side with the
        one refused may finish after the refusal took the others away."""
        if budget.refused is not None:
            _remove(tmp, self.mapping)
            raise budget.refused
        # The marker is written first: a full disk then fails before
        # anything is in place, and leaves neither half behind.
        marker = self.store._marker_file(report)
        try:
            if os.path.lexists(final):
                self.store._unpublish(final, self.mapping)
            os.rename(tmp, final)
            try:
                os.rename(marker, _marker(final))
            except BaseException:
                self.store._unpublish(final, self.mapping)
                raise
        except BaseException:
            marker.unlink(missing_ok=True)
            _remove(tmp, self.mapping)
            raise
        budget.published.append(final)
        self._count(final, {"size": report.size, "entries": report.entries}, budget)

    def _count(self, final: Path, info: dict[str, Any], budget: Budget) -> None:
        """Adds a layer to its image's sums; over the image's bound, the
        layers this session published for it go again."""
        error = budget.add(int(info.get("size") or 0), int(info.get("entries") or 0))
        if error is not None:
            raise self._refused(budget, error)

    def _refused(self, budget: Budget, error: TooLarge) -> TooLarge:
        """A refused image keeps nothing of its own: the layers this pull
        or import unpacked for it go too, but for those another image or a
        sandbox has come to use since (uses.py, host/stacked.py)."""
        budget.refused = error
        named = self.store.named_layers() if budget.published else set()
        in_use = stacked.layers_in_use(self.store.root) if budget.published else set()
        for layer in budget.published:
            with self.counted.alone(layer, budget) as alone:
                if alone and layer.name not in named and os.path.realpath(layer) not in in_use:
                    self.store._unpublish(layer, self.mapping)
        budget.published.clear()
        return error

    async def _unpack(self, blob: str, budget: Budget, feed: Feed | None = None) -> tuple[ApplyReport, Path]:
        name = secrets.token_hex(8)
        tmp = self.staging / name
        allowed = budget.for_layer()
        try:
            report = await self.unpacker.apply(blob, name, *allowed, feed=feed)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                _remove(tmp, self.mapping)
            if isinstance(e, Exceeded):
                raise self._refused(budget, budget.refusal(blob[:19], e.args[0], allowed)) from None
            raise
        summary = report.summary()
        if summary:
            self.progress.note(summary)
        return report, tmp

    async def unpack_image(self, digest: str, *, name: str | None) -> Image:
        """Unpacks every layer of a stored manifest (concurrently)."""
        manifest = self.store.read_json(digest)
        cfg = ImageConfig.parse(self.store.read_json(manifest["config"]["digest"]))
        descs = oci.layer_descriptors(manifest)
        if len(descs) != len(cfg.diff_ids):
            raise NsboxError(f"image {name or digest}: {len(descs)} layers but {len(cfg.diff_ids)} diff_ids")
        budget = Budget(name or digest[:19])
        async with task_group() as tg:
            for d, diff in zip(descs, cfg.diff_ids):
                tg.start_soon(self.layer, d["digest"], diff, budget)

        image = self.store.image(digest, name=name, key=self.mapping.key)
        if image is None:  # an image rm and prune elsewhere, between the two
            raise NsboxError(f"image {name or digest}: its layers were removed while it was being unpacked",
                             hint="pull or import it again")
        return image


if sys.version_info >= (3, 11):
    _Group = BaseExceptionGroup  # noqa: F821
else:
    from exceptiongroup import BaseExceptionGroup as _Group


@contextlib.asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group that raises its first error itself, not an exception
    group: one clear error when, say, one of several layers is damaged."""
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except _Group as group:
        errors = _flatten(group)
        first = next((e for e in errors if isinstance(e, NsboxError)), errors[0])
        raise first from first.__cause__  # its own cause kept (a full disk's errno), not the group


def _flatten(e: BaseException) -> list[BaseException]:
    if isinstance(e, _Group):
        return [x for sub in e.exceptions for x in _flatten(sub)]
    return [e]


def _remove(path: Path, mapping: idmap.IdMap | None) -> None:
    """Deletes a layer directory whatever sandbox users own in it."""
    from ..create.unshare import remove_layer
    from ..host.removal import remove_tree

    try:
        if mapping is not None:
            remove_layer(path, mapping)
        else:
            remove_tree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno not in (errno.ENOENT,):
            raise



def _marker(layer: Path) -> Path:
    return layer.with_name(layer.name + MARK)
