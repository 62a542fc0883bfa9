"""Copies an image's directory into an empty volume (volumes.py runs it).

Runs under the host's python3 (-I -S) as root of a throwaway sandbox with
the user's id mapping: the image's layers are read-only at /layers/N
(lowest first), the volumes to seed at /volumes/N. Argument: JSON
{"layers": [...], "seeds": [[image path, volume dir], ...], "single": bool}.

The image's tree is read as overlayfs would show it (upper layers first,
whiteouts and opaque directories hide lower entries), one component at a
time relative to open directories with O_NOFOLLOW: a symlink in the image
is copied as a symlink, never followed on the host. A symlink on the way to
the mount point is resolved inside the image, as Docker does, `..` stopping
at the image's root. Owners are kept (sandbox root can give any mapped id);
in single mode every file is root's, all a sandbox can represent.
Hardlinks stay links and holes stay holes, and what is written is counted
against the image bounds ("max_bytes", "max_files": storage/bounds.py), so
an image cannot make a volume larger than its own unpacked tree.
"""

import json
import os
import stat
import sys

OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR = OPEN | os.O_DIRECTORY
HOPS = 40  # symlinks followed on the way to the mount point, as the kernel allows


def lstat(fd, name):
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def whiteout(fd, name, st):
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return True
    if stat.S_ISREG(st.st_mode) and st.st_size == 0:  # the xattr form (applytar.py)
        f = os.open(name, OPEN | os.O_NONBLOCK, dir_fd=fd)
        try:
            os.getxattr(f, "user.overlay.whiteout")
            return True
        except OSError:
            return False
        finally:
            os.close(f)
    return False


def opaque(fd):
    try:
        return os.getxattr(fd, "user.overlay.opaque") == b"y"
    except OSError:
        return False


def lookup(fds, name):
    """(stat, fd of the layer that has it, the merged dir's fds if it is a
    directory) of `name` in the merged directory `fds` (topmost first), or
    None where it is absent or whited out."""
    for i, fd in enumerate(fds):
        st = lstat(fd, name)
        if st is None:
            continue
        if whiteout(fd, name, st):
            return None
        if not stat.S_ISDIR(st.st_mode):
            return st, fd, None
        below = []
        for lower in fds[i:]:
            s = lstat(lower, name)
            if s is None:
                continue
            if not stat.S_ISDIR(s.st_mode):
                break  # a file or whiteout below hides everything under it
            below.append(os.open(name, DIR, dir_fd=lower))
            if opaque(below[-1]):
                break
        return st, fd, below
    return None


def resolve(roots, path):
    """The merged directory at `path` in the image, or None."""
    todo = [c for c in path.split("/") if c not in ("", ".")]
    done = []
    hops = 0
    while True:
        fds = roots
        for i, name in enumerate(todo):
            if name == "..":
                todo = done[:-1] + todo[i + 1:]
                break
            found = lookup(fds, name)
            if found is None:
                return None
            st, fd, below = found
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > HOPS:
                    return None
                target = os.readlink(name, dir_fd=fd)
                base = [] if target.startswith("/") else done
                todo = base + [c for c in target.split("/") if c not in ("", ".")] + todo[i + 1:]
                break
            if below is None:
                return None  # not a directory: nothing to seed
            fds = below
            done.append(name)
        else:
            return fds
        done = []


def copy_meta(fd, st, single, name=None, dir_fd=None):
    """Owner, mode and times of `st` onto fd (or onto symlink `name`)."""
    if name is not None:
        if not single:
            try:
                os.chown(name, st.st_uid, st.st_gid, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                pass  # an owner the mapping lacks stays root's
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dir_fd, follow_symlinks=False)
        return
    if not single:
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
        except OSError:
            pass
    os.fchmod(fd, stat.S_IMODE(st.st_mode))  # after chown, which clears set-id bits
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


class Budget:
    """What the copies may still write, and the files copied so far (a
    hardlinked file is copied once, then linked)."""

    def __init__(self, max_bytes, max_files):
        self.bytes, self.files = max_bytes, max_files
        self.links = {}  # (dev, ino) of the image's file -> its copy's path in the volume

    def take(self, nbytes=0, files=0):
        self.bytes -= nbytes
        self.files -= files
        if self.bytes < 0 or self.files < 0:
            sys.exit("seeding the volume would write more than the image bounds allow "
                     "(NSBOX_IMAGE_LIMITS size=, files=)")


def copy_data(src, dst, size, budget):
    """The data of `src` into `dst`, its holes left holes."""
    pos = 0
    while pos < size:
        try:
            pos = os.lseek(src, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = os.lseek(src, pos, os.SEEK_HOLE)
        budget.take(nbytes=end - pos)
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n == 0:
                break
            pos += n
    os.ftruncate(dst, size)


def copy_dir(fds, dest, single, budget, root, rel=""):
    """Copies the merged directory `fds` into the open directory `dest`
    (`rel` below the volume's directory `root`)."""
    names = {}
    for fd in fds:
        names.update(dict.fromkeys(os.listdir(fd)))
    for name in names:
        found = lookup(fds, name)
        if found is None:
            continue
        st, fd, below = found
        mode = st.st_mode
        budget.take(files=1)
        path = f"{rel}/{name}" if rel else name
        if below is not None:
            os.mkdir(name, 0o700, dir_fd=dest)
            sub = os.open(name, DIR, dir_fd=dest)
            try:
                copy_dir(below, sub, single, budget, root, path)
                copy_meta(sub, st, single)
            finally:
                os.close(sub)
                for b in below:
                    os.close(b)
        elif stat.S_ISREG(mode) and (st.st_dev, st.st_ino) in budget.links:
            os.link(budget.links[st.st_dev, st.st_ino], name, src_dir_fd=root, dst_dir_fd=dest, follow_symlinks=False)
        elif stat.S_ISREG(mode):
            src = os.open(name, OPEN, dir_fd=fd)
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dest)
            try:
                copy_data(src, dst, st.st_size, budget)
                copy_meta(dst, st, single)
                if st.st_nlink > 1:
                    budget.links[st.st_dev, st.st_ino] = path
            finally:
                os.close(src)
                os.close(dst)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=fd), name, dir_fd=dest)
            copy_meta(None, st, single, name, dest)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(name, 0o600, dir_fd=dest)
            f = os.open(name, OPEN | os.O_NONBLOCK, dir_fd=dest)
            try:
                copy_meta(f, st, single)
            finally:
                os.close(f)
        # device nodes and sockets: a volume holds none (nor do layers)


def main():
    args = json.loads(sys.argv[1])
    roots = [os.open(p, DIR) for p in reversed(args["layers"])]
    budget = Budget(args["max_bytes"], args["max_files"])
    seeded = []
    for path, volume in args["seeds"]:
        dest = os.open(volume, DIR)
        try:
            if os.listdir(dest):
                continue  # seeded already, or written to: Docker copies into a new volume only
            fds = resolve(roots, path)
            if fds is None:
                continue
            budget.links = {}  # a link never crosses volumes
            copy_dir(fds, dest, args["single"], budget, dest)
            # The volume takes the owner and mode of the image's directory.
            copy_meta(dest, os.fstat(fds[0]), args["single"])
            seeded.append(volume)
        finally:
            os.close(dest)
    print(json.dumps(seeded))


main()
