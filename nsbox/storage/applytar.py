"""Applies one image layer (a tar stream) to an empty directory, for overlayfs.

This file runs INSIDE a throwaway nsbox sandbox, as sandbox root, under the
host's python3 (`python3 -I -S -c SOURCE ARGS_JSON`), so it uses the
standard library only. The sandbox sees the blob read-only (or gets it on
stdin while a pull downloads it: "blob": "-") and one writable staging
directory: the kernel confines what a bug here could touch, and
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
import queue
import stat
import subprocess
import sys
import tarfile
import threading
import urllib.parse
import zlib
from typing import Any, Callable, Iterator, TypeVar

CHUNK = 1 << 20  # decompressed bytes at a time
IN_CHUNK = 1 << 18  # compressed bytes at a time
AHEAD = 8  # decompressed chunks ready ahead of the tar parser
CACHED_DIRS = 256  # directory fds kept open while applying
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."


T = TypeVar("T")


class Corrupt(Exception):
    pass


class Unsafe(Exception):
    pass


class TooBig(Exception):
    """Over a bound: args[0] is "size" or "files"."""


HEADER_LIMIT = 1 << 20  # PAX or GNU long-name header: long names, xattrs (64 KiB each at most)


class BoundedHeaders(tarfile.TarInfo):
    """Members whose extended headers are at most HEADER_LIMIT bytes:
    tarfile reads such a header whole into memory, so a layer of a few
    MiB (gzip expands zeros 1000:1) could otherwise ask for gigabytes."""

    def _proc_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        self._bounded()
        return super()._proc_pax(tarfile_)  # type: ignore[misc]

    def _proc_gnulong(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        self._bounded()
        return super()._proc_gnulong(tarfile_)  # type: ignore[misc]

    def _bounded(self) -> None:
        if self.size > HEADER_LIMIT:
            raise tarfile.HeaderError(f"an extended header of {self.size} bytes (at most {HEADER_LIMIT})")


def _mtime(m: tarfile.TarInfo) -> tuple[int, int]:
    """A member's mtime for utime, clamped: a PAX header may say anything."""
    try:
        t = int(min(max(float(m.mtime), 0.0), 2.0 ** 40))
    except (TypeError, ValueError, OverflowError):
        t = 0
    return (t * 10**9,) * 2


class Reader:
    """The decompressed layer stream, hashed as it is read (the diff_id).

    `path` is the blob, or "-": the compressed stream arrives on stdin (a
    pull streams it from the registry). A thread decompresses and hashes
    ahead (zlib, lzma, bz2 and hashlib let go of the GIL), so that work runs
    on another core while the main thread parses the tar and writes files.
    """

    def __init__(self, path: str, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.raw = open(0 if path == "-" else path, "rb", buffering=0, closefd=path != "-")
        self.head = b""
        while len(self.head) < 6 and (more := self.raw.read(6 - len(self.head))):
            self.head += more  # a pipe may give fewer bytes at a time
        self.hash = hashlib.sha256()
        self.size = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.dec: Any = None
        magic = self.head
        if magic.startswith(b"\x1f\x8b"):
            self.kind = "gzip"
            self.dec = zlib.decompressobj(wbits=31)
        elif magic.startswith(b"\x28\xb5\x2f\xfd"):
            self.kind = "zstd"
            try:
                self.proc = subprocess.Popen(["zstd", "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            except FileNotFoundError:
                raise SystemExit(_fail(1, "this layer is zstd-compressed and the zstd program is missing "
                                          "(apt-get install zstd)"))
            threading.Thread(target=self._feed_zstd, daemon=True).start()
        elif magic.startswith(b"\xfd7zXZ\x00"):
            self.kind = "xz"
            self.dec = lzma.LZMADecompressor()
        elif magic.startswith(b"BZh"):
            self.kind = "bzip2"
            self.dec = bz2.BZ2Decompressor()
        else:
            self.kind = "none"
        self.queue: queue.Queue[bytes | BaseException | None] = queue.Queue(AHEAD)
        self.buf = b""
        self.pos = 0
        self.done = False
        threading.Thread(target=self._produce, daemon=True).start()

    def _raw(self, n: int) -> bytes:
        if self.head:
            data, self.head = self.head, b""
            return data
        return self.raw.read(n)

    def _feed_zstd(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            while data := self._raw(CHUNK):
                self.proc.stdin.write(data)
        except OSError:
            pass  # zstd stopped reading: it says why when it exits
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def _chunks(self) -> Iterator[bytes]:
        """The decompressed stream; reads the compressed one to its end."""
        if self.proc is not None:
            assert self.proc.stdout is not None
            while data := self.proc.stdout.read(CHUNK):
                yield data
            if self.proc.wait() != 0:
                raise Corrupt("zstd could not decompress the layer (corrupt or truncated)")
            return
        if self.dec is None:
            while data := self._raw(CHUNK):
                yield data
            return
        data = b""
        while True:
            if self.dec.eof:
                rest = self.dec.unused_data or self._raw(IN_CHUNK)
                if self.kind != "gzip" or not rest.strip(b"\0"):
                    while self._raw(IN_CHUNK):
                        pass  # what follows the stream is not read as layer, but the writer may not block
                    return
                self.dec = zlib.decompressobj(wbits=31)  # a multi-member gzip file
                data = rest
            if self.kind == "gzip":
                data = data or self._raw(IN_CHUNK)
                hungry = True
            else:
                hungry = self.dec.needs_input
                data = self._raw(IN_CHUNK) if hungry else b""
            if hungry and not data:
                raise Corrupt(f"the {self.kind} stream ends early (truncated)")
            out = self.dec.decompress(data, CHUNK)
            data = self.dec.unconsumed_tail if self.kind == "gzip" else b""
            if out:
                yield out

    def _produce(self) -> None:
        try:
            for data in self._chunks():
                self.hash.update(data)
                self.size += len(data)
                if self.size > self.max_bytes:
                    raise TooBig("size")
                self.queue.put(data)
            self.queue.put(None)
        except (zlib.error, lzma.LZMAError, OSError, EOFError) as e:
            if isinstance(e, OSError) and e.errno is not None:
                self.queue.put(e)
            else:
                self.queue.put(Corrupt(f"the {self.kind} stream is corrupt: {e}"))
        except BaseException as e:
            self.queue.put(e)

    def read(self, n: int = -1) -> bytes:
        if self.pos >= len(self.buf):
            if self.done:
                return b""
            item = self.queue.get()
            if item is None:
                self.done = True
                return b""
            if isinstance(item, BaseException):
                self.done = True
                raise item
            self.buf, self.pos = item, 0
        if n < 0 or (self.pos == 0 and n >= len(self.buf)):
            data = self.buf[self.pos:] if self.pos else self.buf
        else:
            data = self.buf[self.pos:self.pos + n]
        self.pos += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


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
        os.fchmod(self.root, 0o755)  # whatever the umask: see member() on the root
        self.single = single
        self.dirs: dict[tuple[str, ...], tarfile.TarInfo] = {}
        self.cache: dict[tuple[str, ...], int] = {}  # walked directories (not the root)
        self.skipped: dict[str, int] = {}
        self.examples: list[str] = []
        self.files = 0
        self.whiteout_xattr = False
        self.current = ""

    # -- paths --------------------------------------------------------

    def parent(self, parts: list[str], create: bool) -> int:
        """An fd of the directory holding parts[-1], walked without following
        symlinks from the nearest directory already walked; missing
        directories are made when `create`. Not to be closed.

        The fds of walked directories are kept: a directory's path can only
        come to name another inode if that directory is removed, and every
        removal of a directory drops those at or below it (make_room)."""
        key = tuple(parts[:-1])
        fd = self.cache.get(key)
        if fd is not None:
            return fd
        depth = len(key)
        while depth and key[:depth] not in self.cache:
            depth -= 1
        if len(self.cache) + len(key) - depth > CACHED_DIRS:
            self.drop_cache()
            depth = 0
        # Of a path deeper than CACHED_DIRS, only the last levels are kept:
        # the others are closed as the walk goes on.
        keep_from = len(key) - CACHED_DIRS
        fd = self.cache[key[:depth]] if depth else self.root
        loose = -1  # the walk's fd that is not kept, closed once the next is open
        try:
            for i in range(depth, len(key)):
                comp = key[i]
                try:
                    fd = os.open(comp, OPEN_DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise Unsafe("missing in this layer") from None
                    self.count()
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    fd = os.open(comp, OPEN_DIR, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise Unsafe("a parent is a symlink or not a directory") from None
                    raise
                if loose >= 0:
                    os.close(loose)
                    loose = -1
                if i >= keep_from:
                    self.cache[key[:i + 1]] = fd
                else:
                    loose = fd
        except BaseException:
            if loose >= 0:
                os.close(loose)
            raise
        return fd

    def drop_cache(self) -> None:
        for fd in self.cache.values():
            os.close(fd)
        self.cache.clear()

    def make_room(self, pfd: int, parts: list[str], keep_dir: bool) -> bool:
        """Removes what is at `parts` (without following it; `pfd` holds
        it); True if it is a directory that is kept."""
        name = parts[-1]
        try:
            st = os.lstat(name, dir_fd=pfd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            remove_tree(pfd, name)
            gone = tuple(parts)
            for key in [k for k in self.cache if k[:len(gone)] == gone]:
                os.close(self.cache.pop(key))
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
            self.examples.append(shown(name))

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
                fd = os.open(dparts[-1], OPEN_DIR, dir_fd=self.parent(list(dparts), create=False))
            except (Unsafe, OSError):
                continue
            try:
                os.chmod(fd, d.mode & 0o7777)
                os.utime(fd, ns=_mtime(d))
            finally:
                os.close(fd)
        self.drop_cache()

    def member(self, tf: tarfile.TarFile, m: tarfile.TarInfo, parts: list[str]) -> None:
        if not parts:
            # The layer's root keeps 0755 and sandbox root as owner: an
            # overlay's root shows its upper dir's, never a lower layer's,
            # and publishing the layer (a rename to another parent) needs
            # it writable by the unprivileged owner of the store.
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
        if m.isdir():
            try:
                os.mkdir(base, 0o700, dir_fd=pfd)
            except FileExistsError:
                if not self.make_room(pfd, parts, keep_dir=True):
                    os.mkdir(base, 0o700, dir_fd=pfd)
            fd = self.walked(parts, os.open(base, OPEN_DIR, dir_fd=pfd))
            self.owner(fd, None, m)
            self.xattrs(fd, m)
            self.dirs[tuple(parts)] = m
        elif m.issym():
            self.fresh(pfd, parts, lambda: os.symlink(m.linkname, base, dir_fd=pfd))
            self.owner(pfd, base, m)
            os.utime(base, ns=_mtime(m), dir_fd=pfd, follow_symlinks=False)
        elif m.isfifo():
            self.fresh(pfd, parts, lambda: os.mkfifo(base, 0o600, dir_fd=pfd))
            self.owner(pfd, base, m)
            os.chmod(base, m.mode & 0o7777, dir_fd=pfd)
        elif m.isreg():
            fd = self.fresh(pfd, parts, lambda: os.open(base, CREATE, 0o600, dir_fd=pfd))
            try:
                if m.issparse():
                    self.sparse(tf, m, fd)
                else:  # straight from the stream, as tarfile's extractfile would read it
                    tf.fileobj.seek(m.offset_data)  # type: ignore[union-attr]
                    copy(tf.fileobj, m, fd, 0, m.size)
                self.owner(fd, None, m)  # before chmod: chown clears setuid bits
                os.chmod(fd, m.mode & 0o7777)
                self.xattrs(fd, m)  # after chown: it clears security.capability
                os.utime(fd, ns=_mtime(m))
            finally:
                os.close(fd)
            self.files += 1
        else:
            self.make_room(pfd, parts, keep_dir=False)
            self.skip("unknown")

    def fresh(self, pfd: int, parts: list[str], make: Callable[[], T]) -> T:
        """make() creates parts[-1] (never through what is there); what is
        in the way is removed first (rarely: tried after)."""
        try:
            return make()
        except FileExistsError:
            self.make_room(pfd, parts, keep_dir=False)
            return make()

    def walked(self, parts: list[str], fd: int) -> int:
        """Keeps the fd of directory `parts` for the members inside it."""
        key = tuple(parts)
        if key in self.cache:
            os.close(fd)
            return self.cache[key]
        if len(self.cache) >= CACHED_DIRS:
            self.drop_cache()
        self.cache[key] = fd
        return fd

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
            self.make_room(pfd, parts, keep_dir=False)
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
    end = offset + size
    while offset < end:
        data = src.read(min(CHUNK, end - offset))
        if not data:
            raise Corrupt(f"{m.name}: the archive ends inside this file (truncated)")
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            offset += n
            view = view[n:]


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


def shown(text: str) -> str:
    """`text` with its unprintable characters escaped: a member's name may
    hold any (a newline that would fake the line the host parses, a
    terminal's escape sequence)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _fail(code: int, message: str) -> int:
    """Exits with `code`, the message on one line of stderr (the last)."""
    print(shown(message), file=sys.stderr)
    return code


def _bound(args: dict[str, Any], key: str) -> int:
    """A bound from the request: absent is none, 0 is 0 (an image whose
    earlier layers used its bound up leaves the next one nothing)."""
    value = args.get(key)
    return 1 << 62 if value is None else int(value)


def main(argv: list[str]) -> int:
    args = json.loads(argv[1])
    reader = Reader(args["blob"], _bound(args, "max_bytes"))
    applier = Applier(args["dest"], bool(args.get("single")), _bound(args, "max_files"))
    try:
        with tarfile.open(fileobj=reader, mode="r|", tarinfo=BoundedHeaders) as tf:  # type: ignore[call-overload]
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
