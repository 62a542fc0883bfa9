"""Root filesystems, and the ordered setup steps that build a sandbox on one.

Two kinds of root:

- HostRootfs, the built-in default: composed from this host. The host's /usr
  (and the merged-usr links) read-only; a per-sandbox writable /etc that
  shows the host's /etc under fresh passwd/group/shadow files; private
  writable /root, /home, /var/tmp, /run and /tmp. Nothing of the host's
  $HOME, /tmp or /root is visible.
- DirectoryRootfs: a directory holding a root filesystem (an unpacked
  image). It is the read-only lower layer of an overlayfs whose upper layer
  is private to the sandbox, so sandboxes never change it or each other.

Either way the writable layer lives in the sandbox's layer directory on the
host. plan() returns every step, in the order the C helper runs them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from . import native as n
from .dirs import cache_dir, data_dir
from .errors import SandboxSetupError
from .idmap import IdMap

# Host device nodes the sandbox gets, bind-mounted into a fresh /dev.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# Top-level names that are links into /usr on a merged-usr host.
USR_LINK_NAMES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def _escape_overlay_path(path: Path) -> str:
    """overlayfs options are split on ',' and lower layers on ':'."""
    s = os.fspath(path)
    for ch in ("\\", ",", ":"):
        s = s.replace(ch, "\\" + ch)
    return s


def _overlay(lowers: list[Path], upper: Path, work: Path, target: Path, what: str) -> n.Step:
    # userxattr: overlayfs mounted inside a user namespace must keep its
    # metadata in user.* xattrs; without it directory renames fail with EIO.
    data = (
        f"lowerdir={':'.join(_escape_overlay_path(p) for p in lowers)},upperdir={_escape_overlay_path(upper)},"
        f"workdir={_escape_overlay_path(work)},userxattr"
    )
    return n.mount("overlay", os.fspath(target), "overlay", 0, data, what)


_built: dict[str, Path] = {}


def _cached_dir(kind: str, content: object, build: "Callable[[Path], None]") -> Path:
    """A directory built once per content (and kept under the cache dir),
    used as a shared read-only overlay layer. Built aside and renamed into
    place, so concurrent sandboxes never see a half-built one."""
    key = f"{kind}-" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    if key in _built and os.path.isdir(_built[key]):
        return _built[key]
    final = cache_dir() / "layers" / key
    if final.is_dir():
        _built[key] = final
        return final
    final.parent.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    except OSError:
        remove_tree(tmp)
        if not final.is_dir():
            raise
    _built[key] = final
    return final


@dataclass(frozen=True)
class HostRootfs:
    """The built-in default root filesystem, composed from this host.

    Its root is an overlayfs whose lower layer is a cached skeleton (the
    top-level directories, with their modes) and /etc another one: the
    fresh identity files over the host's /etc. A new sandbox needs only
    empty upper layers, which keeps creating and deleting it cheap.
    """

    SKELETON = {
        "etc": 0o755, "usr": 0o755, "root": 0o700, "home": 0o755, "tmp": 0o1777, "var": 0o755,
        "var/tmp": 0o1777, "run": 0o755, "proc": 0o555, "dev": 0o755, "mnt": 0o755,
    }

    def __str__(self) -> str:
        return "host"

    def describe(self) -> str:
        return "the host-composed default (this host's /usr, read-only)"

    LAYER_DIRS = ("upper", "work", "etc-upper", "etc-work")

    def prepare(self, layer: Path, hostname: str) -> None:
        # A disk filesystem charges ~0.1 ms per directory created or
        # removed: an untouched layer of a closed sandbox is reused instead.
        if not _reuse_layer(layer):
            layer.mkdir(mode=0o700)
            for name in self.LAYER_DIRS:
                (layer / name).mkdir()
        for fname, text in (("hostname", f"{hostname}\n"), ("hosts", _hosts(hostname))):
            fd = os.open(layer / "etc-upper" / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)

    def release_layer(self, layer: Path) -> bool:
        """Keeps `layer` for the next sandbox if it is exactly as a new one
        would be (so nothing of this sandbox carries over); True if kept."""
        return _untouched_host_layer(layer) and _keep_layer(layer)

    def identity_files(self) -> dict[str, str]:
        """The sandbox's /etc/passwd and /etc/group as created: known here."""
        return {name: text for name, text, _ in _fresh_etc()}

    def known_dirs(self) -> set[str]:
        return {"/" + d for d in self.SKELETON}

    @staticmethod
    def _usr_links() -> dict[str, str]:
        return {name: os.readlink(f"/{name}") for name in USR_LINK_NAMES if os.path.islink(f"/{name}")}

    @staticmethod
    @functools.cache
    def _real_top_dirs() -> list[str]:
        """/bin, /lib... on a host without merged /usr: bound read-only too."""
        return [
            name for name in USR_LINK_NAMES
            if not os.path.islink(f"/{name}") and os.path.isdir(f"/{name}")
        ]

    @classmethod
    @functools.cache
    def _skeleton(cls) -> Path:
        links, real = cls._usr_links(), cls._real_top_dirs()

        def build(d: Path) -> None:
            for rel, mode in cls.SKELETON.items():
                (d / rel).mkdir()
                os.chmod(d / rel, mode)
            for name, target in links.items():
                os.symlink(target, d / name)
            for name in real:
                (d / name).mkdir()

        return _cached_dir("skeleton", [cls.SKELETON, links, real], build)

    @staticmethod
    @functools.cache
    def _etc() -> Path:
        files = _fresh_etc()

        def build(d: Path) -> None:
            for fname, text, mode in files:
                (d / fname).write_text(text)
                os.chmod(d / fname, mode)

        return _cached_dir("etc", files, build)

    def steps_before_pivot(self, layer: Path, root: Path, slots: "_Slots") -> list[n.Step]:
        steps = [
            _overlay([self._skeleton()], layer / "upper", layer / "work", root,
                     "mount the sandbox root (overlayfs over the host-root skeleton)"),
            _overlay([self._etc(), Path("/etc")], layer / "etc-upper", layer / "etc-work", root / "etc",
                     "mount the writable /etc (overlayfs over the host's /etc)"),
        ]
        for name in ("usr", *self._real_top_dirs()):
            steps.append(n.tree_clone(f"/{name}", slots.take(f"/{name}"),
                                      f"take a read-only copy of the host's /{name}",
                                      recursive=True, readonly=True))
        return steps

    def steps_after_pivot(self, slots: "_Slots") -> list[n.Step]:
        steps = [
            n.tree_attach(slots[f"/{name}"], f"/{name}", f"attach the host's /{name}")
            for name in ("usr", *self._real_top_dirs())
        ]
        steps.append(n.mount("tmpfs", "/run", "tmpfs", n.MS_NOSUID | n.MS_NODEV, "mode=755",
                             "mount a tmpfs on /run"))
        return steps


@dataclass(frozen=True)
class DirectoryRootfs:
    """A directory holding a root filesystem, used as an overlay's lower layer."""

    path: Path

    def __str__(self) -> str:
        return os.fspath(self.path)

    def describe(self) -> str:
        return f"the directory {self.path}"

    def prepare(self, layer: Path, hostname: str) -> None:
        layer.mkdir(mode=0o700)
        for name in ("upper", "work"):
            (layer / name).mkdir()

    def release_layer(self, layer: Path) -> bool:
        # Never reused: overlayfs ties an upper layer to its lower one.
        return False

    def identity_files(self) -> dict[str, str]:
        return {}  # only the sandbox can read them safely (symlinks)

    def known_dirs(self) -> set[str]:
        return set()

    def steps_before_pivot(self, layer: Path, root: Path, slots: "_Slots") -> list[n.Step]:
        return [_overlay([self.path], layer / "upper", layer / "work", root,
                         f"mount the root filesystem (overlayfs over {self.path})")]

    def steps_after_pivot(self, slots: "_Slots") -> list[n.Step]:
        return []


Rootfs = HostRootfs | DirectoryRootfs


@dataclass(frozen=True)
class Bind:
    """A host file or directory made visible inside the sandbox at `target`."""

    source: str
    target: str
    readonly: bool = False

    def __post_init__(self) -> None:
        if not posixpath.isabs(self.target) or posixpath.normpath(self.target) in ("/", "//"):
            raise ValueError(f"bind target must be an absolute path below /, not {self.target!r}")
        if posixpath.normpath(self.target) != self.target.rstrip("/"):
            raise ValueError(f"bind target must be a normalized path, not {self.target!r}")
        if not os.path.exists(self.source):
            raise SandboxSetupError(f"bind source {self.source} does not exist")

    @classmethod
    def parse(cls, spec: str) -> "Bind":
        """SOURCE:TARGET[:ro|:rw], as in `nsbox run -v`."""
        parts = spec.split(":")
        mode = "rw"
        if len(parts) == 3 and parts[2] in ("ro", "rw"):
            mode = parts.pop()
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"expected SOURCE:TARGET[:ro], got {spec!r}")
        return cls(os.path.abspath(os.path.expanduser(parts[0])), parts[1], readonly=mode == "ro")


def resolve(rootfs: str | os.PathLike[str] | None) -> Rootfs:
    """Turns what a user wrote into a root filesystem, or says what is wrong."""
    if rootfs is None or os.fspath(rootfs) == "host":
        return HostRootfs()
    path = Path(os.fspath(rootfs)).expanduser()
    try:
        st = os.stat(path)
    except OSError as e:
        raise SandboxSetupError(f"rootfs {path}: {e.strerror}",
                                hint="give a directory holding a root filesystem, or 'host'") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxSetupError(f"rootfs {path} is not a directory",
                                hint="give a directory holding a root filesystem, or 'host'")
    return DirectoryRootfs(path.resolve())


class _Slots:
    """Numbers the detached mount trees taken before the pivot."""

    def __init__(self) -> None:
        self._by_name: dict[str, int] = {}

    def take(self, name: str) -> int:
        self._by_name[name] = len(self._by_name)
        return self._by_name[name]

    def __getitem__(self, name: str) -> int:
        return self._by_name[name]


def plan(rootfs: Rootfs, layer: Path, root: Path, *, idmap: IdMap, hostname: str,
         private_network: bool, binds: Sequence[Bind] = ()) -> list[n.Step]:
    """Every setup step of a sandbox, in order."""
    slots = _Slots()
    steps = [
        # Nothing we mount may propagate back to the host's mount namespace.
        n.mount(None, "/", None, n.MS_REC | n.MS_PRIVATE, None, "make all mounts private"),
    ]
    # Device nodes cannot be created in a user namespace: take the host's.
    for dev in DEVICES:
        steps.append(n.tree_clone(f"/dev/{dev}", slots.take(f"/dev/{dev}"), f"take the host's /dev/{dev}"))
    for i, bind in enumerate(binds):
        steps.append(n.tree_clone(bind.source, slots.take(f"bind{i}"), f"take a copy of {bind.source}",
                                  recursive=True, readonly=bind.readonly))
    steps += rootfs.steps_before_pivot(layer, root, slots)
    # The kernel mounts a new procfs only while a fully visible one exists
    # in the namespace, so /proc is mounted before the host's goes away.
    proc = os.fspath(root / "proc")
    steps += [
        n.mkdir(proc, 0o555),
        n.mount("proc", proc, "proc", n.MS_NOSUID | n.MS_NODEV | n.MS_NOEXEC, None, "mount a fresh /proc"),
        n.pivot(os.fspath(root)),
    ]
    # From here on every path is inside the sandbox: a symlink in the root
    # filesystem can only lead somewhere else inside it.
    steps += rootfs.steps_after_pivot(slots)
    steps += _dev_tmp(slots, idmap)
    for i, bind in enumerate(binds):
        steps += _bind_steps(bind, slots[f"bind{i}"])
    steps.append(n.hostname(hostname))
    if private_network:
        steps.append(n.loopback_up())
    return steps


def _dev_tmp(slots: _Slots, idmap: IdMap) -> list[n.Step]:
    nosuid_nodev = n.MS_NOSUID | n.MS_NODEV
    steps = [
        n.mkdir("/dev"),
        n.mount("tmpfs", "/dev", "tmpfs", n.MS_NOSUID | n.MS_NOEXEC, "mode=755,size=1m",
                "mount a tmpfs on /dev"),
    ]
    for dev in DEVICES:
        steps += [n.mkfile(f"/dev/{dev}"), n.tree_attach(slots[f"/dev/{dev}"], f"/dev/{dev}", f"attach /dev/{dev}")]
    # A private devpts instance; group tty (5) owns ptys when it is mapped.
    pts = "newinstance,ptmxmode=0666,mode=620" + (",gid=5" if idmap.size > 5 else "")
    steps += [
        n.mkdir("/dev/pts"),
        n.mount("devpts", "/dev/pts", "devpts", n.MS_NOSUID | n.MS_NOEXEC, pts, "mount a private devpts"),
        n.symlink("pts/ptmx", "/dev/ptmx"),
        n.mkdir("/dev/shm"),
        n.mount("tmpfs", "/dev/shm", "tmpfs", nosuid_nodev, "mode=1777", "mount a tmpfs on /dev/shm"),
        n.symlink("/proc/self/fd", "/dev/fd"),
        n.symlink("/proc/self/fd/0", "/dev/stdin"),
        n.symlink("/proc/self/fd/1", "/dev/stdout"),
        n.symlink("/proc/self/fd/2", "/dev/stderr"),
        n.mkdir("/tmp"),
        n.mount("tmpfs", "/tmp", "tmpfs", nosuid_nodev, "mode=1777", "mount a tmpfs on /tmp"),
    ]
    return steps


def _bind_steps(bind: Bind, slot: int) -> list[n.Step]:
    """Creates the mount point (and missing parents) and attaches the bind."""
    parts = bind.target.strip("/").split("/")
    steps = [n.mkdir("/" + "/".join(parts[:i])) for i in range(1, len(parts))]
    target = "/" + "/".join(parts)
    steps.append(n.mkdir(target) if os.path.isdir(bind.source) else n.mkfile(target))
    steps.append(n.tree_attach(slot, target, f"attach {bind.source} at {target}"))
    return steps


def mount_point() -> Path:
    """Where a sandbox's root is mounted before pivot_root. One directory
    serves every sandbox: each mounts on it in its own mount namespace."""
    path = data_dir() / "mnt"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _hosts(hostname: str) -> str:
    return f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"


def _fresh_etc() -> list[tuple[str, str, int]]:
    """The identity files of the host-composed root: only root and nobody.

    Their backups ("passwd-"...), the shadow tools' lock and the subordinate
    id files come along: those of the host belong to real root, which a
    rootless sandbox cannot write or copy up, and useradd/groupadd touch
    them all.
    """
    shell = "/bin/bash" if os.path.exists("/usr/bin/bash") else "/bin/sh"
    identity = [
        ("passwd", f"root:x:0:0:root:/root:{shell}\n"
                   "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n", 0o644),
        ("group", "root:x:0:\ntty:x:5:\nnogroup:x:65534:\n", 0o644),
        ("shadow", "root:*:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n", 0o600),
        ("gshadow", "root:*::\ntty:*::\nnogroup:*::\n", 0o600),
        ("subuid", "", 0o644),
        ("subgid", "", 0o644),
    ]
    return identity + [(f"{name}-", text, mode) for name, text, mode in identity] + [(".pwd.lock", "", 0o600)]


def remove_tree(path: Path) -> None:
    """Deletes a layer directory, including directories without write or
    search permission (overlayfs leaves a mode-000 work dir; /proc is 0555).

    Raises PermissionError when files owned by other sandbox users remain;
    the caller then removes them from inside a user namespace.
    """
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except PermissionError:
        pass
    uid = os.geteuid()
    for dirpath, _dirs, _files in os.walk(path, topdown=True, onerror=lambda e: None):
        # os.walk lists a directory after it is yielded, so fixing the mode
        # here lets it descend into directories we could not read.
        if os.lstat(dirpath).st_uid == uid:
            os.chmod(dirpath, 0o700)
        for d in _dirs:
            full = os.path.join(dirpath, d)
            st = os.lstat(full)
            if st.st_uid == uid and not stat.S_ISLNK(st.st_mode):
                os.chmod(full, 0o700)
    shutil.rmtree(path)


# What prepare() and overlayfs leave in a layer the sandbox never wrote to,
# deepest first; no other kind of layer exists.
_UNTOUCHED = ("etc-upper/hosts", "etc-upper/hostname", "work/work", "etc-work/work",
              "upper", "work", "etc-upper", "etc-work", "")


def remove_untouched_layer(layer: Path) -> bool:
    """Deletes `layer` if it holds only what a new sandbox has (a handful of
    syscalls, no directory walk); False if the sandbox wrote to it."""
    for rel in _UNTOUCHED:
        path = os.path.join(layer, rel) if rel else os.fspath(layer)
        try:
            if rel.startswith("etc-upper/"):
                os.unlink(path)
            else:
                os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False  # not empty: the sandbox wrote something
    return True


# At most this many untouched host-root layers wait for reuse.
REUSE_MAX = 4
_OVERLAY_XATTRS = {"user.overlay.uuid"}


def _untouched_host_layer(layer: Path) -> bool:
    """Whether the sandbox left `layer` as prepare() made it: no entry in its
    upper layers but our two files (regular, single-linked), no attribute
    or xattr changed. Anything else, and the layer is deleted instead."""
    uid = os.geteuid()
    try:
        for name, allowed in (("upper", set()), ("etc-upper", {"hosts", "hostname"}),
                              ("work", {"work"}), ("etc-work", {"work"})):
            path = os.path.join(layer, name)
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o755:
                return False
            entries = set(os.listdir(path))
            if name.endswith("upper"):
                if entries != allowed or set(os.listxattr(path)) - _OVERLAY_XATTRS:
                    return False
            elif not entries <= allowed:
                return False
        for fname in ("hosts", "hostname"):
            st = os.lstat(os.path.join(layer, "etc-upper", fname))
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o644:
                return False
    except OSError:
        return False
    return True


REUSE = ".reuse"  # the directory of layers kept for reuse, in layers_dir()


def _reuse_dir() -> Path:
    return layers_dir() / REUSE


def _keep_layer(layer: Path) -> bool:
    reuse = _reuse_dir()
    try:
        if len(os.listdir(reuse)) >= REUSE_MAX:
            return False
    except FileNotFoundError:
        reuse.mkdir(mode=0o700, exist_ok=True)
    try:
        os.rename(layer, reuse / layer.name)
    except OSError:
        return False
    return True


def _reuse_layer(layer: Path) -> bool:
    """Moves a kept layer to `layer`; False if there is none."""
    try:
        names = os.listdir(_reuse_dir())
    except FileNotFoundError:
        return False
    for name in names:
        try:
            os.rename(_reuse_dir() / name, layer)
            return True
        except OSError:
            continue  # another process took it
    return False


def layers_dir() -> Path:
    path = data_dir() / "sandboxes"
    if not path.is_dir():
        path.mkdir(mode=0o700, exist_ok=True)
    return path


def remove_layer(layer: Path, mapping: IdMap | None) -> None:
    """Deletes a layer directory, from inside a user namespace with the
    sandbox's mapping when other sandbox users own files in it."""
    try:
        remove_tree(layer)
    except PermissionError:
        if mapping is None or mapping.mode != "subuid":
            raise
        from .unshare import run_in_userns

        run_in_userns(mapping, ["rm", "-rf", "--", os.fspath(layer)])
