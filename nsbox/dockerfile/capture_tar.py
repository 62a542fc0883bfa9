"""Archives an overlay upper directory as an OCI layer tar.

This file runs INSIDE an nsbox sandbox with the build's id mapping, as
sandbox root, under the host's python3 (`python3 -I -S -c SOURCE ARGS_JSON`;
standard library only): the upper directory's files belong to mapped ids
(subordinate ids, in subuid mode), which only a process of that user
namespace reads as the sandbox ids they are. It sees the upper directory
read-only at ARGS["upper"] and writes the tar to ARGS["out"].

Overlay's own markers become OCI's: a whiteout (a 0/0 character device, or
an empty file with the `user.overlay.whiteout` xattr) becomes `.wh.NAME`,
an opaque directory (`user.overlay.opaque=y`; overlay runs with userxattr)
gets a `.wh..wh..opq` member. A file's capabilities (`security.capability`,
what `setcap` sets) are kept as a PAX record, as Docker keeps them; other
xattrs, sockets and devices are left out. Prints one JSON line: the tar's
digest (its diff_id), size and count.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
import tarfile


class Hashing:
    def __init__(self, f):  # type: ignore[no-untyped-def]
        self.f, self.hash, self.size = f, hashlib.sha256(), 0

    def write(self, data):  # type: ignore[no-untyped-def]
        self.hash.update(data)
        self.size += len(data)
        return self.f.write(data)


# Nothing below the upper directory is followed: a name that is no
# longer what it was when looked at (a symlink, a FIFO swapped in) fails
# the archive instead of reading through it. The step's processes are
# stopped before this runs; this is the second guard.
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Changed(Exception):
    pass


def xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def opened(name: str, dir_fd: int, flags: int, st: os.stat_result) -> int:
    """`name` opened without following it, if it is still the file `st` says."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):  # a symlink or nothing now
            raise Changed(name) from None
        raise
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode)) != (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)):
        os.close(fd)
        raise Changed(name)
    return fd


def header(rel: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.type, info.size, info.linkname = kind, size, link
    info.mode, info.uid, info.gid, info.mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)
    return info


def marker(name: str, like: tarfile.TarInfo) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime, info.mode = like.mtime, 0o644
    return info


def archive(tar: tarfile.TarFile, root: int, exclude: set[str]) -> int:
    """Adds everything below the directory `root`, parents first; the count."""
    count = 0
    links: dict[tuple[int, int], str] = {}  # hardlinked files: the first name archived
    stack = [(root, "", iter(sorted(os.listdir(root))))]
    while stack:
        dfd, rel_dir, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            if dfd != root:
                os.close(dfd)
            continue
        rel = f"{rel_dir}/{name}" if rel_dir else name
        if rel in exclude:
            continue
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            fd = opened(name, dfd, OPEN_DIR, st)
            stack.append((fd, rel, iter(sorted(os.listdir(fd)))))
            info = header(rel, st, tarfile.DIRTYPE)
            tar.addfile(info)
            if xattr(fd, "user.overlay.opaque") == b"y":
                tar.addfile(marker(f"{rel}/.wh..wh..opq", info))
                count += 1
        elif stat.S_ISREG(mode):
            with os.fdopen(opened(name, dfd, OPEN_FILE, st), "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size == 0 and xattr(f.fileno(), "user.overlay.whiteout") is not None:
                    info = marker(f"{rel_dir}/.wh.{name}".lstrip("/"), header(rel, st, tarfile.REGTYPE))
                    tar.addfile(info)
                elif st.st_nlink > 1 and (st.st_dev, st.st_ino) in links:
                    tar.addfile(header(rel, st, tarfile.LNKTYPE, link=links[st.st_dev, st.st_ino]))
                else:
                    if st.st_nlink > 1:
                        links[st.st_dev, st.st_ino] = rel
                    info = header(rel, st, tarfile.REGTYPE, st.st_size)
                    caps = xattr(f.fileno(), "security.capability")
                    if caps is not None:  # binary: tarfile writes it back byte for byte
                        info.pax_headers["SCHILY.xattr.security.capability"] = caps.decode("utf-8", "surrogateescape")
                    tar.addfile(info, f)
        elif stat.S_ISCHR(mode) and st.st_rdev == 0:  # overlay's whiteout
            tar.addfile(marker(f"{rel_dir}/.wh.{name}".lstrip("/"), header(rel, st, tarfile.CHRTYPE)))
        elif stat.S_ISLNK(mode):
            tar.addfile(header(rel, st, tarfile.SYMTYPE, link=os.readlink(name, dir_fd=dfd)))
        elif stat.S_ISFIFO(mode):
            tar.addfile(header(rel, st, tarfile.FIFOTYPE))
        else:
            continue  # sockets and device nodes
        count += 1
    return count


def main() -> int:
    args = json.loads(sys.argv[1])
    root = os.open(args["upper"], OPEN_DIR)
    with open(args["out"], "wb") as raw:
        out = Hashing(raw)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            try:
                count = archive(tar, root, set(args.get("exclude", ())))
            except Changed as e:
                print(f"{e} changed while it was archived", file=sys.stderr)
                return 1
    print(json.dumps({"diff_id": f"sha256:{out.hash.hexdigest()}", "size": out.size, "files": count}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
