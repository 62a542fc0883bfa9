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
gets a `.wh..wh..opq` member. Other xattrs, sockets and devices are left
out. Prints one JSON line: the tar's digest (its diff_id), size and count.
"""

from __future__ import annotations

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


def xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def marker(name: str, like: tarfile.TarInfo) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime, info.mode = like.mtime, 0o644
    return info


def main() -> int:
    args = json.loads(sys.argv[1])
    upper, exclude = args["upper"], set(args.get("exclude", ()))
    count = 0
    with open(args["out"], "wb") as raw:
        out = Hashing(raw)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for dirpath, dirnames, filenames in os.walk(upper):
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, upper)
                rel_dir = "" if rel_dir == "." else rel_dir
                if rel_dir and xattr(dirpath, "user.overlay.opaque") == b"y":
                    tar.addfile(marker(f"{rel_dir}/.wh..wh..opq", tar.gettarinfo(dirpath, rel_dir)))
                    count += 1
                for name in sorted(dirnames + filenames):
                    path = os.path.join(dirpath, name)
                    rel = os.path.join(rel_dir, name)
                    if rel in exclude:
                        continue
                    st = os.lstat(path)
                    info = tar.gettarinfo(path, rel)
                    whiteout = (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0) or (
                        stat.S_ISREG(st.st_mode) and st.st_size == 0
                        and xattr(path, "user.overlay.whiteout") is not None)
                    if whiteout:
                        tar.addfile(marker(os.path.join(rel_dir, ".wh." + name), info))
                    elif info is None or info.ischr() or info.isblk():
                        continue  # sockets and device nodes
                    else:
                        info.uname = info.gname = ""
                        if info.isreg():
                            with open(path, "rb") as f:
                                tar.addfile(info, f)
                        else:
                            tar.addfile(info)
                    count += 1
    print(json.dumps({"diff_id": f"sha256:{out.hash.hexdigest()}", "size": out.size, "files": count}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
