"""Where sandboxes' layers live on the host: writable layers, their reuse,
the shared read-only layers nsbox builds, and the mount point.

A sandbox's writable layer is a directory under the data dir holding
overlayfs upper and work directories. Its entries belong to sandbox root's
host ids (for real root a subordinate id, see nsbox/host/idmap.py). Creating and
deleting directories is what a new sandbox costs most on a disk
filesystem, so a layer its sandbox never wrote to is kept for the next
sandbox of its kind (untouched_layer() says what "never wrote" means). This module
knows the shape of each kind of layer; deleting layers is nsbox/host/removal.py's.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .dirs import data_dir
from .probe import kernel_version
from .removal import grant, remove_tree, sweep_later


def cached_dir(kind: str, content: object, build: "Callable[[Path], None]", owner: tuple[int, int],
               cache: Path) -> Path:
    """A directory built once per content (and kept under `cache`, the
    cache dir), used as a shared read-only overlay layer, its entries owned
    by `owner` (sandbox root's host ids). Built aside and renamed into
    place, so concurrent sandboxes never see a half-built one."""
    key = f"{kind}-" + hashlib.sha256(json.dumps([content, owner], sort_keys=True).encode()).hexdigest()[:16]
    final = cache / "layers" / key
    if final.is_dir():
        return final
    final.parent.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        give(tmp, owner)
        os.rename(tmp, final)
    except OSError:
        remove_tree(tmp)
        if not final.is_dir():
            raise
    return final


def write_file(path: str | os.PathLike[str], text: str, owner: tuple[int, int]) -> None:
    """Writes a small file nsbox puts into a layer (never through a
    symlink), owned by sandbox root's host ids."""
    # Overwritten in place, truncated only if it was longer: a recycled
    # layer has these files already, and O_TRUNC of a file with data costs
    # a journal transaction on ext4 (~0.15 ms here, against ~8 us).
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        st = os.fstat(fd)
        if st.st_size != len(data):
            os.ftruncate(fd, len(data))
        if (st.st_uid, st.st_gid) != owner:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)


def give(path: Path, owner: tuple[int, int]) -> None:
    """Hands `path` and what it holds to sandbox root's host ids, when those
    are not ours (real root maps its sandboxes onto a subordinate range)."""
    if owner == (os.geteuid(), os.getegid()):
        return
    os.lchown(path, *owner)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), *owner)


def mount_point(owner: tuple[int, int]) -> Path:
    """The directory whose subdirectory "root" a sandbox's root is mounted on
    before pivot_root. One serves every sandbox of an id mapping: each
    mounts on it in its own mount namespace. It belongs to sandbox root,
    which must be able to search it."""
    base = data_dir() / "mnt"
    known = _mount_points.get((base, owner))
    if known is not None and os.path.isdir(known[1]):
        return known[0]
    path = base / str(owner[0])
    if not (path / "root").is_dir():
        base.mkdir(mode=0o700, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        (path / "root").mkdir(mode=0o700, exist_ok=True)
        for p in (path, path / "root"):
            if os.lstat(p).st_uid != owner[0]:
                os.lchown(p, *owner)
    _mount_points[(base, owner)] = (path, os.fspath(path / "root"))
    return path


_mount_points: dict[tuple[Path, tuple[int, int]], tuple[Path, str]] = {}


# At most this many untouched layers (of any kind) wait for reuse.
REUSE_MAX = 4
# What overlayfs writes into an upper layer on mount: the upper root's
# persistent uuid (with uuid=auto, on the first mount of an upper dir not
# marked impure). It names the overlay instance and becomes its statfs
# f_fsid, so a kept layer loses it; the next mount writes a fresh one.
_UUID = "user.overlay.uuid"
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FS_IOC_GETFLAGS = 0x80086601  # chattr's flags (nodump, noatime...)

# The kinds of writable layer: their directories (each with the entries
# it may hold when untouched; the invisible work dirs first: they set the
# expected group) and the files prepare() writes. A layer is only ever
# reused for a sandbox of its kind.
HOST_LAYER = "host"  # HostRootfs: the root and the /etc overlays, both upper layers here
# HostRootfs where /etc's upper layer is in memory (etc_upper_in_memory()):
# "etc" holds the sandbox's own /etc files, as /etc's top lower layer.
HOST_MEMORY_ETC_LAYER = "host-etc"
DIR_LAYER = "dir"  # DirectoryRootfs, ImageRootfs: one overlay over any lower stack
# The sandbox's own /etc files that HostRootfs.prepare() writes, and the
# directory of a host layer they go in.
ETC_FILES = ("hostname", "hosts")
ETC_DIRS = {HOST_LAYER: "etc-upper", HOST_MEMORY_ETC_LAYER: "etc"}
_SHAPES: dict[str, tuple[dict[str, set[str]], tuple[str, ...]]] = {
    HOST_LAYER: ({"work": set(), "etc-work": set(), "upper": set(), "etc-upper": set(ETC_FILES)},
                 tuple(f"etc-upper/{name}" for name in ETC_FILES)),
    HOST_MEMORY_ETC_LAYER: ({"work": set(), "upper": set(), "etc": set(ETC_FILES)},
                            tuple(f"etc/{name}" for name in ETC_FILES)),
    DIR_LAYER: ({"work": set(), "upper": set()}, ()),
}
# What prepare() leaves in a layer the sandbox never wrote to, once
# set_aside_work() has taken overlayfs's work out, for every kind of layer:
# the files, then the directories, then the layer.
_UNTOUCHED_FILES = tuple(dict.fromkeys(rel for _, files in _SHAPES.values() for rel in files))
_UNTOUCHED = (*_UNTOUCHED_FILES, *dict.fromkeys(name for dirs, _ in _SHAPES.values() for name in dirs), "")


def layer_dirs(kind: str) -> tuple[str, ...]:
    """The directories a new layer of this kind has."""
    return tuple(_SHAPES[kind][0])


def remove_untouched_layer(layer: Path) -> bool:
    """Deletes `layer` if it holds only what a new sandbox has (a handful of
    syscalls, no directory walk); False if the sandbox wrote to it."""
    for rel in _UNTOUCHED:
        path = os.path.join(layer, rel) if rel else os.fspath(layer)
        try:
            if rel in _UNTOUCHED_FILES:
                os.unlink(path)
            else:
                os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False  # not empty: the sandbox wrote something
    return True


@functools.cache
def etc_upper_in_memory() -> bool:
    """Whether the host-composed root keeps /etc's upper layer on a tmpfs
    (nsbox/plan/overlay.py memory_overlay()) rather than in the layer directory:
    where tmpfs keeps user.* xattrs (Linux 6.6), which overlayfs needs
    under userxattr to delete or rename directories of a lower layer. On
    a disk, each new sandbox costs overlayfs a work dir made and deleted
    and its feature probes; on a tmpfs, nothing that outlives it."""
    version = kernel_version()
    if version is None or version < (6, 6):
        return False
    # The release says tmpfs can; a kernel built without tmpfs xattrs
    # cannot. /dev/shm is a tmpfs almost everywhere: ask it.
    try:
        with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix=".nsbox-xattr-") as f:
            os.setxattr(f.fileno(), "user.nsbox", b"1")
    except OSError as e:
        return e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP)
    return True


def _flags(fd: int) -> int | None:
    try:
        return int.from_bytes(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))[:4], sys.byteorder)
    except OSError:
        return None  # not supported by this filesystem: nothing to compare


def untouched_layer(layer: Path, uid: int, kind: str) -> bool:
    """Whether the sandbox left `layer` as prepare() made it, so that nothing
    of it can reach the next sandbox: its upper dirs empty but for
    prepare()'s files (regular, single-linked, owned by `uid`), owner,
    group, mode, size, xattrs (but overlay's uuid) and chattr flags as a
    new one's; the work dirs empty (set_aside_work). Times are reset when
    the layer is reused. Anything else, and the layer is deleted instead."""
    dirs, files = _SHAPES[kind]
    try:
        fd = os.open(layer, _OPEN_DIR)
        try:
            # The layer dir is ours and invisible to the sandbox: a new
            # upper dir, made in it, gets its inheritable flags and size.
            ref, ref_flags = os.fstat(fd), _flags(fd)
        finally:
            os.close(fd)
        gid = -1
        for name, allowed in dirs.items():
            fd = os.open(os.path.join(layer, name), _OPEN_DIR)
            try:
                st = os.fstat(fd)
                gid = st.st_gid if gid == -1 else gid
                if st.st_uid != uid or st.st_gid != gid or stat.S_IMODE(st.st_mode) != 0o755:
                    return False
                entries = set(os.listdir(fd))
                if name.endswith("upper"):
                    if (entries != allowed or set(os.listxattr(fd)) - {_UUID} or st.st_size != ref.st_size
                            or st.st_nlink != 2 or _flags(fd) != ref_flags):
                        return False
                elif not entries <= allowed or os.listxattr(fd):
                    return False
            finally:
                os.close(fd)
        for rel in files:
            fd = os.open(os.path.join(layer, rel), _OPEN_FILE)
            try:
                st = os.fstat(fd)
                if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != uid or st.st_gid != gid
                        or stat.S_IMODE(st.st_mode) != 0o644 or os.listxattr(fd) or _flags(fd) != ref_flags):
                    return False
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


REUSE = ".reuse"  # the directory of layers kept for reuse, in layers_dir()
TRASH = ".trash"  # what set_aside_work() moved out of layers, in layers_dir()
WORK_DIRS = ("work", "etc-work")  # a layer's overlay work dirs (the kinds in _SHAPES)


def set_aside_work(layer: Path) -> bool:
    """Moves what overlayfs left in the work dirs of a closed sandbox's
    layer (their "work" subdirectory; with `volatile`, a marker below it
    that the kernel refuses to mount over) into the trash, which a thread
    empties (removal.sweep_later). True if the work dirs are empty now.
    A rename instead of deleting: removing directories is what costs on a
    disk filesystem."""
    trash = layer.parent / TRASH  # a layer lives in layers_dir()
    moved = False
    for name in WORK_DIRS:
        work, dest = layer / name / "work", trash / f"{layer.name}.{name}"
        if not os.path.lexists(work):
            continue
        try:
            try:
                os.rename(work, dest)
            except FileNotFoundError:  # no trash directory yet
                trash.mkdir(mode=0o700, exist_ok=True)
                os.rename(work, dest)
            except PermissionError:
                # Moving a directory to another parent rewrites its "..":
                # without root, that needs write permission on it, and
                # overlayfs makes it mode 000.
                os.close(grant(work))
                os.rename(work, dest)
        except OSError:
            return False
        moved = True
    if moved:
        sweep_later(trash)
    return True


def _reuse_dir(layer: Path) -> Path:
    return layer.parent / REUSE  # a layer lives in layers_dir()


def _pool_name(kind: str, name: str) -> str:
    # Host layers keep their bare name (sandbox ids are hex: no dot).
    return name if kind == HOST_LAYER else f"{kind}.{name}"


def _of_kind(pool_name: str, kind: str) -> bool:
    return "." not in pool_name if kind == HOST_LAYER else pool_name.startswith(f"{kind}.")


def keep_layer(layer: Path, kind: str = HOST_LAYER) -> bool:
    """Puts an untouched layer (see untouched_layer) in the reuse pool, its
    upper dirs stripped of overlay's uuid; False if the pool is full or
    that fails (the caller deletes the layer)."""
    reuse = _reuse_dir(layer)
    try:
        if len(os.listdir(reuse)) >= REUSE_MAX:
            return False
    except FileNotFoundError:
        reuse.mkdir(mode=0o700, exist_ok=True)
    try:
        for name in _SHAPES[kind][0]:
            if name.endswith("upper"):
                try:
                    os.removexattr(os.path.join(layer, name), _UUID, follow_symlinks=False)
                except OSError as e:
                    if e.errno != errno.ENODATA:
                        raise
        os.rename(layer, reuse / _pool_name(kind, layer.name))
    except OSError:
        return False
    return True


def reuse_layer(layer: Path, owner: tuple[int, int], kind: str = HOST_LAYER) -> bool:
    """Moves a kept layer of this kind made for the same owner to `layer`,
    its upper dirs and files given the times of new ones; False if there is
    none.

    Any lower stack may take a kept layer: an upper dir holds nothing tied
    to its lowers but overlay's xattrs, and keep_layer() took a layer only
    with no xattr but the uuid, which it removed."""
    reuse = _reuse_dir(layer)
    try:
        names = os.listdir(reuse)
    except FileNotFoundError:
        return False
    dirs, files = _SHAPES[kind]
    touched = [name for name in dirs if name.endswith("upper")] + list(files)
    for name in names:
        if not _of_kind(name, kind):
            continue
        kept = os.path.join(reuse, name)
        try:
            if os.lstat(os.path.join(kept, "upper")).st_uid != owner[0]:
                continue  # another id mapping's: gc collects it
            for rel in touched:  # the sandbox may have set them (touch -d)
                os.utime(os.path.join(kept, rel), follow_symlinks=False)
        except OSError:
            continue
        try:
            os.rename(kept, layer)
        except OSError:
            continue  # another process took it
        # New again: until its sandbox is registered, only its age keeps
        # `nsbox gc` from taking it for an orphan (manage.garbage).
        os.utime(layer, follow_symlinks=False)
        return True
    return False


_layers_dirs: dict[Path, Path] = {}


def layers_dir() -> Path:
    data = data_dir()
    path = _layers_dirs.get(data)
    if path is None or not os.path.isdir(path):
        path = data / "sandboxes"
        path.mkdir(mode=0o700, exist_ok=True)
        _layers_dirs[data] = path
    return path
