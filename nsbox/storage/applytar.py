"""Applies one image layer (a tar stream) to an empty directory, for overlayfs.

This file runs INSIDE a throwaway nsbox sandbox, as sandbox root, under the
host's python3 (`python3 -I -S -c SOURCE ARGS_JSON`), so it uses the
standard library only. The sandbox sees the blob read-only and one writable
staging directory: the kernel confines what a bug here could touch, and
applies the owner's id mapping to every chown. On top of that, every path is
resolved component by component with O_NOFOLLOW from the layer's root, so a
member never lands outside the layer or goes through a symlink:

- `..` components: the member is skipped; a leading `/` is dropped;
- a parent that is a symlink (or not a directory): the member is skipped;
- an existing entry is unlinked before a new one is created (never opened
  for writing), so a planted symlink or hardlink is replaced, not followed;
- a hardlink must name an entry of this layer, resolved the same way;
- device nodes are skipped (counted); FIFOs are made;
- sparse members stay sparse: only their data is written;
- the uncompressed stream and the entries created (a member's missing
  parents included) are bounded (`max_bytes`, `max_files`): exit 4;
- whiteouts: `.wh.NAME` becomes an overlay whiteout (a 0/0 character
  device, or the `user.overlay.whiteout` xattr form where mknod is refused),
  `.wh..wh..opq` sets `user.overlay.opaque="y"` (overlay runs with userxattr);
- xattrs from PAX headers are kept, except overlay's own (`*.overlay.*`),
  which would let a layer steer the overlay mount.

It prints one JSON line: the uncompressed digest (the layer's diff_id) and
what was skipped. Exit 3: the blob is corrupt or truncated; 4: over a bound
("size" or "files" on stderr); 5: a limit reached (a full disk: the errno
first on stderr); 1: other errors.
"""

from __future__ import annotations

import base64
import bz2
import errno
import hashlib
import json
import lzma
import os
import stat
import subprocess
import sys
import tarfile
import urllib.parse
import zlib
from typing import Any

CHUNK = 1 << 20
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."


class Corrupt(Exception):
    pass


class Unsafe(Exception):
    pass


class TooBig(Exception):
    """Over a bound: args[0] is "size" or "files"."""


def _mtime(m: tarfile.TarInfo) -> tuple[int, int]:
    """A member's mtime for utime, clamped: a PAX header may say anything."""
    try:
        t = int(min(max(float(m.mtime), 0.0), 2.0 ** 40))
    except (TypeError, ValueError, OverflowError):
        t = 0
    return (t * 10**9,) * 2


class Reader:
    """The decompressed layer stream, hashed as it is read (the diff_id)."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.raw = open(path, "rb", buffering=0)  # unbuffered: zstd reads the same fd
        magic = self.raw.read(6)
        self.raw.seek(0)
        self.hash = hashlib.sha256()
        self.size = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""
        self.dec: Any = None
        if magic.startswith(b"\x1f\x8b"):
            self.kind = "gzip"
            self.dec = zlib.decompressobj(wbits=31)
        elif magic.startswith(b"\x28\xb5\x2f\xfd"):
            self.kind = "zstd"
            try:
                self.proc = subprocess.Popen(["zstd", "-dcq"], stdin=self.raw, stdout=subprocess.PIPE)
            except FileNotFoundError:
                raise SystemExit(_fail(1, "this layer is zstd-compressed and the zstd program is missing "
                                          "(apt-get install zstd)"))
        elif magic.startswith(b"\xfd7zXZ\x00"):
            self.kind = "xz"
            self.dec = lzma.LZMADecompressor()
        elif magic.startswith(b"BZh"):
            self.kind = "bzip2"
            self.dec = bz2.BZ2Decompressor()
        else:
            self.kind = "none"

    def _more(self, n: int) -> bytes:
        if self.proc is not None:
            assert self.proc.stdout is not None
            return self.proc.stdout.read(n)
        if self.dec is None:
            return self.raw.read(n)
        out = b""
        while not out:
            if self.dec.eof:
                rest = self.dec.unused_data
                if self.kind != "gzip" or not rest.strip(b"\0"):
                    return b""
                self.dec = zlib.decompressobj(wbits=31)  # a multi-member gzip file
                out = self.dec.decompress(rest, n)
                continue
            if self.kind == "gzip":
                data = self.dec.unconsumed_tail or self.raw.read(CHUNK)
                hungry = True
            else:
                hungry = self.dec.needs_input
                data = self.raw.read(CHUNK) if hungry else b""
            if hungry and not data:
                raise Corrupt(f"the {self.kind} stream ends early (truncated)")
            out = self.dec.decompress(data, n)
        return out

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = CHUNK
        try:
            data = self._more(n)
        except (zlib.error, lzma.LZMAError, OSError, EOFError) as e:
            if isinstance(e, OSError) and e.errno is not None:
                raise
            raise Corrupt(f"the {self.kind} stream is corrupt: {e}") from None
        self.hash.update(data)
        self.size += len(data)
        if self.size > self.max_bytes:
            raise TooBig("size")
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass
        if self.proc is not None and self.proc.wait() != 0:
            raise Corrupt("zstd could not decompress the layer (corrupt or truncated)")


def clean(name: str) -> list[str] | None:
    """The path components of a member name; None if it has `..`."""
    parts = []
    for p in name.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            return None
        parts.append(p)
    return parts


class Applier:
    def __init__(self, dest: str, single: bool, max_files: int) -> None:
        os.mkdir(dest, 0o755)
        self.max_files = max_files
        self.entries = 0
        self.root = os.open(dest, OPEN_DIR)
        self.single = single
        self.dirs: dict[tuple[str, ...], tarfile.TarInfo] = {}
        self.cache: tuple[tuple[str, ...], int] | None = None
        self.skipped: dict[str, int] = {}
        self.examples: list[str] = []
        self.files = 0
        self.whiteout_xattr = False
        self.current = ""

    # -- paths --------------------------------------------------------

    def parent(self, parts: list[str], create: bool) -> int:
        """An fd of the directory holding parts[-1], walked without following
        symlinks; missing directories are made when `create`. Not to be closed."""
        key = tuple(parts[:-1])
        if self.cache and self.cache[0] == key:
            return self.cache[1]
        fd = os.dup(self.root)
        try:
            for comp in key:
                try:
                    nfd = os.open(comp, OPEN_DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise Unsafe("missing in this layer") from None
                    self.count()
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    nfd = os.open(comp, OPEN_DIR, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise Unsafe("a parent is a symlink or not a directory") from None
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        self.drop_cache()
        self.cache = (key, fd)
        return fd

    def drop_cache(self) -> None:
        if self.cache:
            os.close(self.cache[1])
            self.cache = None

    def make_room(self, pfd: int, name: str, keep_dir: bool) -> bool:
        """Removes what is at `name` (without following it); True if it is
        a directory that is kept."""
        try:
            st = os.lstat(name, dir_fd=pfd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            self.drop_cache()
            remove_tree(pfd, name)
        else:
            os.unlink(name, dir_fd=pfd)
        return False

    def count(self) -> None:
        """One more entry (or member read): bounded, like the bytes."""
        self.entries += 1
        if self.entries > self.max_files:
            raise TooBig("files")

    def skip(self, kind: str, name: str = "") -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        if name and kind in ("unsafe", "hardlink") and len(self.examples) < 5:
            self.examples.append(name)

    # -- members ------------------------------------------------------

    def apply(self, tf: tarfile.TarFile) -> None:
        for m in tf:
            self.count()
            parts = clean(m.name)
            if parts is None:
                self.skip("unsafe", m.name)
                continue
            if m.name.startswith("/"):
                self.skip("absolute")
            self.current = m.name
            try:
                self.member(tf, m, parts)
            except Unsafe:
                self.skip("unsafe", m.name)
        self.drop_cache()
        # Directories last: entries created in them changed their mtime,
        # and a read-only mode must not stop the unpacking.
        for dparts, d in sorted(self.dirs.items(), key=lambda kv: -len(kv[0])):
            try:
                # Opened without following: a later member may have made it a symlink.
                fd = os.open(dparts[-1], OPEN_DIR, dir_fd=self.parent(list(dparts), create=False)) \
                    if dparts else os.dup(self.root)
            except (Unsafe, OSError):
                continue
            try:
                os.chmod(fd, d.mode & 0o7777)
                os.utime(fd, ns=_mtime(d))
            finally:
                os.close(fd)
        self.drop_cache()

    def member(self, tf: tarfile.TarFile, m: tarfile.TarInfo, parts: list[str]) -> None:
        if not parts:  # the layer's root itself
            if m.isdir():
                self.owner(self.root, None, m)
                self.dirs[()] = m
            return
        base = parts[-1]
        if base == OPAQUE:
            pfd = self.parent(parts, create=True) if len(parts) > 1 else self.root
            os.setxattr(pfd, "user.overlay.opaque", b"y")
            return
        if base.startswith(WHITEOUT):
            self.whiteout(parts[:-1] + [base[len(WHITEOUT):]])
            return
        pfd = self.parent(parts, create=True)
        if m.ischr() or m.isblk():
            self.skip("devices")
            return
        if m.islnk():
            self.hardlink(m, parts, pfd)
            return
        kept = self.make_room(pfd, base, keep_dir=m.isdir())
        if m.isdir():
            if not kept:
                os.mkdir(base, 0o700, dir_fd=pfd)
            fd = os.open(base, OPEN_DIR, dir_fd=pfd)
            try:
                self.owner(fd, None, m)
                self.xattrs(fd, m)
            finally:
                os.close(fd)
            self.dirs[tuple(parts)] = m
        elif m.issym():
            os.symlink(m.linkname, base, dir_fd=pfd)
            self.owner(pfd, base, m)
            os.utime(base, ns=_mtime(m), dir_fd=pfd, follow_symlinks=False)
        elif m.isfifo():
            os.mkfifo(base, 0o600, dir_fd=pfd)
            self.owner(pfd, base, m)
            os.chmod(base, m.mode & 0o7777, dir_fd=pfd)
        elif m.isreg():
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=pfd)
            try:
                src = tf.extractfile(m)
                assert src is not None
                if m.issparse():
                    self.sparse(tf, m, fd)
                else:
                    copy(src, m, fd, 0, m.size)
                self.owner(fd, None, m)  # before chmod: chown clears setuid bits
                os.chmod(fd, m.mode & 0o7777)
                self.xattrs(fd, m)  # after chown: it clears security.capability
                os.utime(fd, ns=_mtime(m))
            finally:
                os.close(fd)
            self.files += 1
        else:
            self.skip("unknown")

    def sparse(self, tf: tarfile.TarFile, m: tarfile.TarInfo, fd: int) -> None:
        """Writes only the data of a sparse member; its holes stay holes
        (tarfile would read them back as zeros, to be written out). The
        archive holds the data segments one after the other."""
        stream = tf.fileobj
        stream.seek(m.offset_data)  # type: ignore[union-attr]
        end = 0
        for offset, size in m.sparse or ():
            if size == 0:
                continue
            if offset < end or offset + size > m.size:
                raise Corrupt(f"{m.name}: a sparse map out of order or past the file's end")
            copy(stream, m, fd, offset, size)
            end = offset + size
        os.ftruncate(fd, m.size)

    def whiteout(self, parts: list[str]) -> None:
        name = parts[-1]
        if name in ("", ".", "..") or name.startswith(WHITEOUT):
            self.skip("unsafe", "/".join(parts))
            return
        pfd = self.parent(parts, create=True)
        try:
            os.lstat(name, dir_fd=pfd)
            return  # this layer has it: the whiteout only hides lower layers
        except FileNotFoundError:
            pass
        try:
            os.mknod(name, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
        except PermissionError:
            # Kernels before 5.8 refuse mknod in a user namespace; overlay
            # (6.7+) also takes an empty file marked with xattrs.
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=pfd)
            try:
                os.setxattr(fd, "user.overlay.whiteout", b"")
            finally:
                os.close(fd)
            os.setxattr(pfd, "user.overlay.whiteouts", b"")
            self.whiteout_xattr = True

    def hardlink(self, m: tarfile.TarInfo, parts: list[str], pfd: int) -> None:
        target = clean(m.linkname)
        if not target:
            self.skip("unsafe", m.name)
            return
        try:
            tfd = os.dup(self.parent(target, create=False))
        except Unsafe:
            self.skip("hardlink", m.name)
            return
        try:
            pfd = self.parent(parts, create=True)
            try:
                if os.path.samestat(os.lstat(parts[-1], dir_fd=pfd), os.lstat(target[-1], dir_fd=tfd)):
                    return
            except FileNotFoundError:
                pass
            self.make_room(pfd, parts[-1], keep_dir=False)
            pfd = self.parent(parts, create=True)
            try:
                os.link(target[-1], parts[-1], src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
            except (FileNotFoundError, PermissionError, IsADirectoryError):
                self.skip("hardlink", m.name)  # not in this layer, or a directory
        finally:
            os.close(tfd)

    # -- metadata -----------------------------------------------------

    def owner(self, fd: int, name: str | None, m: tarfile.TarInfo) -> None:
        if self.single or (m.uid == 0 and m.gid == 0):
            return  # single-uid mode: everything is sandbox root's
        try:
            if name is None:
                os.chown(fd, m.uid, m.gid)
            else:
                os.chown(name, m.uid, m.gid, dir_fd=fd, follow_symlinks=False)
        except OverflowError:
            self.skip("owners")  # not even an id: stays root's
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.skip("owners")  # an id the mapping does not have: stays root's

    def xattrs(self, fd: int, m: tarfile.TarInfo) -> None:
        for key, value in m.pax_headers.items():
            if key.startswith("SCHILY.xattr."):
                name, raw = key[len("SCHILY.xattr."):], value.encode("utf-8", "surrogateescape")
            elif key.startswith("LIBARCHIVE.xattr."):
                name = urllib.parse.unquote(key[len("LIBARCHIVE.xattr."):])
                raw = base64.b64decode(value + "=" * (-len(value) % 4))
            else:
                continue
            if ".overlay." in name or name.startswith("trusted."):
                self.skip("xattrs")
                continue
            try:
                os.setxattr(fd, name, raw)
            except OSError:
                self.skip("xattrs")


def copy(src: Any, m: tarfile.TarInfo, fd: int, offset: int, size: int) -> None:
    """`size` bytes of the member from where `src` is to `offset` in fd."""
    os.lseek(fd, offset, os.SEEK_SET)
    remaining = size
    while remaining > 0:
        data = src.read(min(CHUNK, remaining))
        if not data:
            raise Corrupt(f"{m.name}: the archive ends inside this file (truncated)")
        remaining -= len(data)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def remove_tree(pfd: int, name: str) -> None:
    """rm -rf of name in pfd, never following a symlink."""
    fd = os.open(name, OPEN_DIR, dir_fd=pfd)
    try:
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.lstat(entry, dir_fd=fd).st_mode):
                remove_tree(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=pfd)


# What writing the layer fails with when the disk (or memory, or descriptors) runs out.
LIMIT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EMFILE, errno.ENFILE)


def _fail(code: int, message: str) -> int:
    print(message, file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    args = json.loads(argv[1])
    reader = Reader(args["blob"], int(args.get("max_bytes") or 1 << 62))
    applier = Applier(args["dest"], bool(args.get("single")), int(args.get("max_files") or 1 << 62))
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tf:  # type: ignore[call-overload]
            applier.apply(tf)
        reader.drain()
    except TooBig as e:
        return _fail(4, str(e))
    except (Corrupt, tarfile.TarError, EOFError, UnicodeError) as e:
        return _fail(3, f"corrupt or truncated layer: {e}")
    except (ValueError, OverflowError) as e:  # a NUL in a name, a number out of range
        return _fail(3, f"corrupt layer: {applier.current or 'a member'}: {e}")
    except OSError as e:
        if e.errno in LIMIT_ERRNOS:
            return _fail(5, f"{e.errno} {applier.current or 'the layer'}: {e}")
        return _fail(1, f"{applier.current or 'the layer'}: {e}")
    report = {
        "diff_id": "sha256:" + reader.hash.hexdigest(), "size": reader.size, "compression": reader.kind,
        "files": applier.files, "entries": applier.entries, "skipped": applier.skipped, "examples": applier.examples,
        "whiteout_xattr": applier.whiteout_xattr,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
