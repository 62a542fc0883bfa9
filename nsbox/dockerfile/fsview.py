"""An image's file tree as its layer tars say it is, read on the host.

COPY --from, `--chown=NAME` and COPY's destination rules need to know what
an image holds. Its unpacked layer directories hold files owned by mapped
ids that this user may not be able to read (subuid mode); its layer blobs
are plain files of ours whose members carry the sandbox ids. So the view
is built from the blobs' tar headers (whiteouts and opaque directories
applied, upper layers winning), and member data is read from the blobs.
"""

from __future__ import annotations

import contextlib
import copy
import posixpath
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import NsboxError
from ..storage.applytar import BoundedHeaders

OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."


def norm(name: str) -> str:
    """A member name as a clean relative path ("" for the root)."""
    path = posixpath.normpath("/" + name).lstrip("/")
    return "" if path == "." else path


@dataclass(frozen=True)
class Entry:
    info: tarfile.TarInfo
    blob: Path  # the layer blob holding it


@contextlib.contextmanager
def open_layer(path: Path) -> Iterator[tarfile.TarFile]:
    """A layer blob as a tar stream, whatever its compression."""
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(0)
        if head == b"\x28\xb5\x2f\xfd":  # zstd: tarfile cannot read it
            proc = subprocess.Popen(["zstd", "-dcq"], stdin=f, stdout=subprocess.PIPE)
            assert proc.stdout is not None
            try:
                with tarfile.open(fileobj=proc.stdout, mode="r|", tarinfo=BoundedHeaders) as tf:
                    yield tf
            finally:
                proc.kill()
                proc.wait()
            return
        with tarfile.open(fileobj=f, mode="r|*", tarinfo=BoundedHeaders) as tf:
            yield tf


class View:
    def __init__(self, entries: dict[str, Entry] | None = None) -> None:
        self.entries: dict[str, Entry] = dict(entries or {})

    def with_layer(self, blob: Path) -> View:
        """The view with one more layer on top."""
        view = View(self.entries)
        members = []
        try:
            with open_layer(blob) as tf:
                for m in tf:
                    members.append(m)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise NsboxError(f"cannot read layer {blob.name}: {e}") from None
        for m in members:  # whiteouts hide lower layers only: first
            path = norm(m.name)
            base = posixpath.basename(path)
            parent = posixpath.dirname(path)
            if base == OPAQUE:
                view._drop_below(parent)
            elif base.startswith(WHITEOUT):
                view._drop(posixpath.join(parent, base[len(WHITEOUT):]))
        for m in members:
            path = norm(m.name)
            if not path or posixpath.basename(path).startswith(WHITEOUT):
                continue
            if not m.isdir():
                view._drop_below(path)
            view.entries[path] = Entry(m, blob)
        return view

    def _drop(self, path: str) -> None:
        self.entries.pop(path, None)
        self._drop_below(path)

    def _drop_below(self, path: str) -> None:
        prefix = f"{path}/" if path else ""
        for key in [k for k in self.entries if k.startswith(prefix)]:
            del self.entries[key]

    def resolve(self, path: str, follow_last: bool = True) -> str:
        """`path` (absolute or relative to /) with symlinks resolved inside
        the image, as the image's own processes would see it."""
        parts = [p for p in norm(path).split("/") if p]
        done: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if done:
                    done.pop()
                continue
            here = "/".join([*done, part])
            entry = self.entries.get(here)
            if entry is not None and entry.info.issym() and (parts or follow_last):
                hops += 1
                if hops > 40:
                    raise NsboxError(f"too many levels of symbolic links at /{here}")
                target = entry.info.linkname
                parts = [p for p in target.split("/") if p and p != "."] + parts
                if target.startswith("/"):
                    done = []
                continue
            done.append(part)
        return "/".join(done)

    def get(self, path: str) -> Entry | None:
        return self.entries.get(norm(path))

    def is_dir(self, path: str) -> bool:
        p = norm(path)
        if not p:
            return True
        entry = self.entries.get(p)
        return entry is not None and entry.info.isdir()

    def below(self, path: str) -> list[str]:
        """Every path under the directory `path`, sorted."""
        prefix = f"{path}/" if path else ""
        return sorted(k for k in self.entries if k.startswith(prefix))

    def read(self, path: str, limit: int = 1 << 20) -> bytes | None:
        """A small regular file's content (None if missing or not a file)."""
        p = self.resolve(path)
        entry = self.entries.get(p)
        if entry is None:
            return None
        if entry.info.islnk():  # names a regular file of the same layer (never a link: no loop)
            p = norm(entry.info.linkname)
            entry = self.entries.get(p)
            if entry is None:
                return None
        if not entry.info.isreg():
            return None
        with open_layer(entry.blob) as tf:
            for m in tf:
                if norm(m.name) == p:
                    f = tf.extractfile(m)
                    return f.read(limit) if f is not None else None
        return None


def copy_data(wanted: dict[Path, dict[str, list[str]]], link_targets: dict[Path, set[str]],
              emit: Callable[[str, tarfile.TarInfo, IO[bytes] | None], None]) -> None:
    """Streams each blob once, calling emit(dest_name, member, data) for
    every member named in wanted[blob] (member name -> destination names).
    A hardlink becomes a copy of its target (in the same layer, earlier in
    it), whose data is kept aside as the stream passes it: link_targets."""
    for blob, names in wanted.items():
        targets = link_targets.get(blob, set())
        kept: dict[str, IO[bytes]] = {}
        with open_layer(blob) as tf:
            for m in tf:
                name = norm(m.name)
                if m.isreg() and name in targets:
                    kept[name] = _spool(tf.extractfile(m))
                for dest in names.get(name, ()):
                    if m.islnk():
                        data = kept.get(norm(m.linkname))
                        if data is None:
                            continue  # a hardlink to nothing: nothing to copy
                        data.seek(0, 2)
                        info = copy.copy(m)
                        info.type, info.linkname, info.size = tarfile.REGTYPE, "", data.tell()
                        data.seek(0)
                        emit(dest, info, data)
                    elif m.isreg():
                        data = kept.get(name)
                        if data is not None:
                            data.seek(0)
                        emit(dest, m, data or tf.extractfile(m))
                    else:
                        emit(dest, m, None)


def _spool(src: IO[bytes] | None) -> IO[bytes]:
    spool = tempfile.SpooledTemporaryFile(1 << 20)
    while src is not None and (chunk := src.read(1 << 20)):
        spool.write(chunk)
    return spool  # type: ignore[return-value]
