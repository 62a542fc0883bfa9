"""Writing a layer tar (COPY, ADD, a captured RUN) into the store's temp
directory, hashed as it is written: an uncompressed layer's blob digest
is its diff_id.

Names are placed as the image's own processes would see them: their
parent directories through the image's symlinks (resolved inside its
root), so that a COPY into /lib of a usrmerge image writes below /usr/lib
and /lib stays a symlink. Parent directories of what a layer adds go in
it too, as Docker's layers have them: with the metadata the image already
gives them (from the view), or 0755 and the COPY's owner (root unless
--chown) when the layer creates them.
"""

from __future__ import annotations

import copy
import hashlib
import os
import posixpath
import stat
import tarfile
import time
from pathlib import Path
from typing import IO

from ..errors import NsboxError
from .context import Context
from .errors import BuildError
from .fsview import View, norm


def clone(info: tarfile.TarInfo, **changes: object) -> tarfile.TarInfo:
    """A copy of a member's header without its PAX extras (source names, xattrs)."""
    new = copy.copy(info)
    new.pax_headers = {}
    for k, v in changes.items():
        setattr(new, k, v)
    return new


class NotADirectory(NsboxError):
    """A name below a file of the image (Docker fails there too)."""


class _Hashing:
    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.hash, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.f.write(data)


class LayerWriter:
    """A tar being written to `path`; `digest` once closed."""

    def __init__(self, path: Path, view: View) -> None:
        self.path = path
        self.view = view
        self._file = open(path, "wb")
        self._out = _Hashing(self._file)
        self._tar = tarfile.open(fileobj=self._out, mode="w|", format=tarfile.PAX_FORMAT)  # type: ignore[arg-type]
        self._written: set[str] = set()
        self.now = int(time.time())
        self.digest = ""
        self.count = 0

    def _parents(self, name: str, owner: tuple[int, int] | None) -> None:
        parent = posixpath.dirname(name)
        if not parent or parent in self._written:
            return
        self._parents(parent, owner)
        existing = self.view.get(parent)
        if existing is not None and existing.info.isdir():
            info = clone(existing.info, name=parent)
        elif existing is not None:  # symlinks are resolved (_place): a file, say
            raise NotADirectory(f"cannot write /{name}: /{parent} is not a directory in the image")
        else:
            info = tarfile.TarInfo(parent)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, self.now
            info.uid, info.gid = owner or (0, 0)
        self._tar.addfile(info)
        self._written.add(parent)

    def _place(self, name: str, is_dir: bool = False) -> str:
        """Where `name` goes in the image: its parent directories resolved
        through the image's symlinks, and a directory's own name too where
        it leads to a directory or to nothing yet (as its contents do)."""
        parent, base = posixpath.split(name)
        placed = norm(posixpath.join(self.view.resolve(parent), base))
        if is_dir:
            target = self.view.resolve(placed)
            if self.view.get(target) is None or self.view.is_dir(target):
                return target
        return placed

    def add(self, name: str, info: tarfile.TarInfo, data: IO[bytes] | None = None, *,
            owner: tuple[int, int] | None = None, mode: int | None = None) -> None:
        """Adds a member as `name`, with `owner` and `mode` if given (the
        owner also of the parent directories it creates)."""
        name = self._place(norm(name), info.isdir())
        if not name:
            return
        self._parents(name, owner)
        info = clone(info, name=name, uname="", gname="")
        if info.islnk():  # its target was placed the same way
            info.linkname = self._place(norm(info.linkname))
        if owner is not None:
            info.uid, info.gid = owner
        if mode is not None and not info.issym():
            info.mode = mode
        if name in self._written and info.isdir():
            return  # a directory both sources have: the first one's metadata
        self._tar.addfile(info, data if info.isreg() else None)
        self._written.add(name)
        self.count += 1

    def add_context_file(self, name: str, ctx: Context, rel: str, *, owner: tuple[int, int] | None = None,
                         mode: int | None = None) -> None:
        """A file, directory or symlink of the build context (read beneath
        its root: context.py); a hardlink is copied whole."""
        st = ctx.lstat(rel)
        info = tarfile.TarInfo(name)
        info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
        owner = owner or (0, 0)
        if stat.S_ISREG(st.st_mode):
            with ctx.open(rel, st) as f:
                info.size = os.fstat(f.fileno()).st_size
                try:
                    self.add(name, info, f, owner=owner, mode=mode)
                except OSError as e:
                    if e.errno is not None:
                        raise
                    # tarfile's "unexpected end of data": the file shrank
                    # after its size went into the header (the layer is dropped)
                    raise BuildError(f"{rel} in the build context changed while it was read (shorter now)") from None
        elif stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
            info.type = tarfile.DIRTYPE if stat.S_ISDIR(st.st_mode) else tarfile.SYMTYPE
            info.linkname = ctx.readlink(rel) if info.issym() else ""
            self.add(name, info, owner=owner, mode=mode)
        # sockets, devices, FIFOs: not copied

    def add_download(self, name: str, path: Path, *, owner: tuple[int, int] | None = None, mode: int) -> None:
        """A file ADD downloaded (into the store's temp directory)."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            info = tarfile.TarInfo(name)
            info.size, info.mtime = st.st_size, int(st.st_mtime)
            self.add(name, info, f, owner=owner or (0, 0), mode=mode)

    def add_dir(self, name: str, *, owner: tuple[int, int]) -> None:
        """A directory of mode 0755 (WORKDIR's), with its missing parents."""
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, self.now
        self.add(name, info, owner=owner)

    def add_bytes(self, name: str, data: bytes, *, owner: tuple[int, int] | None = None, mode: int = 0o644,
                  mtime: int | None = None) -> None:
        import io

        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), mode, self.now if mtime is None else mtime
        self.add(name, info, io.BytesIO(data), owner=owner or (0, 0))

    def close(self) -> str:
        self._tar.close()
        self._file.close()
        self.digest = f"sha256:{self._out.hash.hexdigest()}"
        return self.digest

    def abort(self) -> None:
        try:
            self._tar.close()
        except Exception:
            pass
        self._file.close()
        self.path.unlink(missing_ok=True)
