"""Root filesystems: the kinds a sandbox can start from.

Three kinds of root (each a Rootfs):

- HostRootfs, the built-in default: composed from this host. The host's /usr
  (and the merged-usr links) read-only; a per-sandbox writable /etc that
  shows the host's /etc under fresh passwd/group/shadow files; private
  writable /root, /home, /var/tmp, /run and /tmp. Nothing of the host's
  $HOME, /tmp or /root is visible.
- DirectoryRootfs: a directory holding a root filesystem (an unpacked
  image). It is the read-only lower layer of an overlayfs whose upper layer
  is private to the sandbox, so sandboxes never change it or each other.
- ImageRootfs: an image's unpacked layers, stacked as the lower layers of
  such an overlay.

Either way the writable layer lives in the sandbox's layer directory on the
host (nsbox/host/layers.py). Each kind contributes its mounts to the sandbox's
plan (nsbox/plan/plan.py, nsbox/plan/mounts.py), its overlays through
nsbox/plan/overlay.py.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from . import steps
from ..errors import SandboxSetupError
from ..host.dirs import cache_dir
from ..host.layers import (
    DIR_LAYER,
    ETC_DIRS,
    ETC_FILES,
    HOST_LAYER,
    HOST_MEMORY_ETC_LAYER,
    cached_dir,
    etc_upper_in_memory,
    give,
    keep_layer,
    layer_dirs,
    reuse_layer,
    untouched_layer,
    write_file,
)
from .overlay import memory_overlay, overlay
from .plan import Phase, Plan

if TYPE_CHECKING:
    from ..spec import SandboxSpec

# Top-level names that are links into /usr on a merged-usr host.
USR_LINK_NAMES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class Rootfs:
    """What every kind of root filesystem offers a sandbox and its plan."""

    # Whether the sandbox gets a fresh tmpfs on /tmp (nsbox/plan/mounts.py).
    tmpfs_tmp: ClassVar[bool] = True
    # The writable mounts the root is made of, inside the sandbox (what
    # read_only makes read-only: nsbox/plan/mounts.py).
    own_mounts: ClassVar[tuple[str, ...]] = ("/",)

    def describe(self) -> str:
        """The root in words, for messages."""
        raise NotImplementedError

    def prepare(self, layer: Path, hostname: str, owner: tuple[int, int]) -> None:
        """Makes (or reuses) the sandbox's writable layer directory."""
        raise NotImplementedError

    def release_layer(self, layer: Path, owner: tuple[int, int]) -> bool:
        """Keeps `layer` for the next sandbox if it is exactly as a new one
        would be (so nothing of this sandbox carries over); True if kept."""
        raise NotImplementedError

    def identity_files(self) -> dict[str, str]:
        """The sandbox's /etc/passwd and /etc/group where known without it."""
        raise NotImplementedError

    def known_dirs(self) -> set[str]:
        """Directories known to exist in the root without looking."""
        raise NotImplementedError

    def contribute(self, plan: Plan, layer: Path) -> None:
        """The root's mounts, in the sandbox's plan."""
        raise NotImplementedError


@dataclass(frozen=True)
class HostRootfs(Rootfs):
    """The built-in default root filesystem, composed from this host.

    Its root is an overlayfs whose lower layer is a cached skeleton (the
    top-level directories, with their modes) and /etc another one: the
    fresh identity files over the host's /etc, under the sandbox's own
    (hostname, hosts). A new sandbox needs only empty upper layers, which
    keeps creating and deleting it cheap. /etc's upper layer is in memory
    where the kernel allows (layers.etc_upper_in_memory()), as /tmp is:
    what a sandbox writes there is small, and a disk charges every
    overlay mount a work dir to make and delete.
    """

    own_mounts: ClassVar[tuple[str, ...]] = ("/", "/etc")
    SKELETON = {
        "etc": 0o755, "usr": 0o755, "root": 0o700, "home": 0o755, "tmp": 0o1777, "var": 0o755,
        "var/tmp": 0o1777, "run": 0o755, "proc": 0o555, "dev": 0o755, "mnt": 0o755,
    }

    def __str__(self) -> str:
        return "host"

    def describe(self) -> str:
        return "the host-composed default (this host's /usr, read-only)"

    @staticmethod
    def layer_kind() -> str:
        return HOST_MEMORY_ETC_LAYER if etc_upper_in_memory() else HOST_LAYER

    @classmethod
    def etc_dir(cls, layer: Path) -> Path:
        """Where the sandbox's own /etc files go in its layer."""
        return layer / ETC_DIRS[cls.layer_kind()]

    def prepare(self, layer: Path, hostname: str, owner: tuple[int, int]) -> None:
        # A disk filesystem charges ~0.1 ms per directory created or
        # removed: an untouched layer of a closed sandbox is reused instead.
        kind = self.layer_kind()
        if not reuse_layer(layer, owner, kind):
            layer.mkdir(mode=0o700)
            for name in layer_dirs(kind):
                (layer / name).mkdir()
                give(layer / name, owner)
        texts = {"hostname": f"{hostname}\n", "hosts": _hosts(hostname)}
        for fname in ETC_FILES:
            write_file(self.etc_dir(layer) / fname, texts[fname], owner)

    def release_layer(self, layer: Path, owner: tuple[int, int]) -> bool:
        """Keeps `layer` for the next sandbox if it is exactly as a new one
        would be (so nothing of this sandbox carries over); True if kept."""
        kind = self.layer_kind()
        return untouched_layer(layer, owner[0], kind) and keep_layer(layer, kind)

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

    # The cached layers are looked up once per owner and cache directory
    # (which NSBOX_STATE_DIR or XDG_CACHE_HOME can change in a process).
    @classmethod
    @functools.cache
    def _skeleton(cls, owner: tuple[int, int], cache: Path) -> Path:
        links, real = cls._usr_links(), cls._real_top_dirs()

        def build(d: Path) -> None:
            for rel, mode in cls.SKELETON.items():
                (d / rel).mkdir()
                os.chmod(d / rel, mode)
            for name, target in links.items():
                os.symlink(target, d / name)
            for name in real:
                (d / name).mkdir()

        return cached_dir("skeleton", [cls.SKELETON, links, real], build, owner, cache)

    @staticmethod
    @functools.cache
    def _etc(owner: tuple[int, int], cache: Path) -> Path:
        files = _fresh_etc()

        def build(d: Path) -> None:
            for fname, text, mode in files:
                (d / fname).write_text(text)
                os.chmod(d / fname, mode)

        return cached_dir("etc", files, build, owner, cache)

    def contribute(self, plan: Plan, layer: Path) -> None:
        owner, cache = plan.idmap.host_root, cache_dir()
        overlay(plan, [self._skeleton(owner, cache)], layer / "upper", layer / "work", plan.root,
                "mount the sandbox root (overlayfs over the host-root skeleton)")
        etc, what = self._etc(owner, cache), "mount the writable /etc (overlayfs over the host's /etc)"
        if self.layer_kind() == HOST_MEMORY_ETC_LAYER:
            memory_overlay(plan, [self.etc_dir(layer), etc, Path("/etc")], "etc", f"{plan.root}/etc", what)
        else:
            overlay(plan, [etc, Path("/etc")], layer / "etc-upper", layer / "etc-work", f"{plan.root}/etc", what)
        # nosuid: the host's setuid binaries must not raise anyone's
        # privileges inside (with host root mapped they would).
        for name in ("usr", *self._real_top_dirs()):
            plan.add(Phase.HOST, steps.tree_clone(f"/{name}", plan.slot(f"/{name}"),
                                                  f"take a read-only copy of the host's /{name}",
                                                  recursive=True, readonly=True, nosuid=True))
            plan.add(Phase.INSIDE, steps.tree_attach(plan.slot(f"/{name}"), f"/{name}", f"attach the host's /{name}"))
        plan.add(Phase.INSIDE, steps.mkdir("/run"))
        plan.tmpfs("/run", 0o755, "mount a tmpfs on /run")


class OverlayRootfs(Rootfs):
    """A root that is one overlay over read-only lower directories, its upper
    layer in the sandbox's layer directory."""

    def lower_dirs(self) -> list[Path]:
        """The overlay's lower directories, topmost first."""
        raise NotImplementedError

    def prepare(self, layer: Path, hostname: str, owner: tuple[int, int]) -> None:
        # As for the host root, an untouched layer of a closed sandbox is
        # reused: that of any directory or image (nsbox/host/layers.py says why).
        if reuse_layer(layer, owner, DIR_LAYER):
            return
        layer.mkdir(mode=0o700)
        for name in layer_dirs(DIR_LAYER):
            (layer / name).mkdir()
            give(layer / name, owner)

    def release_layer(self, layer: Path, owner: tuple[int, int]) -> bool:
        """Keeps `layer` for the next sandbox if it is exactly as a new one
        would be (so nothing of this sandbox carries over); True if kept."""
        return untouched_layer(layer, owner[0], DIR_LAYER) and keep_layer(layer, DIR_LAYER)

    def identity_files(self) -> dict[str, str]:
        return {}  # only the sandbox can read them safely (symlinks)

    def known_dirs(self) -> set[str]:
        return set()

    def contribute(self, plan: Plan, layer: Path) -> None:
        overlay(plan, self.lower_dirs(), layer / "upper", layer / "work", plan.root,
                f"mount the root filesystem (overlayfs over {self.describe()})")


@dataclass(frozen=True)
class DirectoryRootfs(OverlayRootfs):
    """A directory holding a root filesystem, used as an overlay's lower layer."""

    path: Path

    def __str__(self) -> str:
        return os.fspath(self.path)

    def describe(self) -> str:
        return f"the directory {self.path}"

    def lower_dirs(self) -> list[Path]:
        return [self.path]


@dataclass(frozen=True)
class ImageRootfs(OverlayRootfs):
    """An image's layers (nsbox/storage), each unpacked once and shared by
    every image that has it, stacked as the lower layers of one overlay:
    a sandbox costs no copy."""

    name: str
    layers: tuple[Path, ...]  # lowest first
    # An image's /tmp is its own (in the writable layer), as in Docker and
    # docker build: a file a Dockerfile left there stays visible, and what a
    # RUN writes there is kept (nsbox/dockerfile/run.py).
    tmpfs_tmp: ClassVar[bool] = False

    @classmethod
    def of(cls, image: Any) -> "ImageRootfs":
        """The root filesystem of a resolved nsbox.storage Image."""
        return cls(image.name, tuple(image.layers))

    def __str__(self) -> str:
        return self.name or os.fspath(self.layers[-1])

    def describe(self) -> str:
        return f"the image {self.name} ({len(self.layers)} layers)"

    def lower_dirs(self) -> list[Path]:
        """Topmost first, each layer once: overlayfs refuses a directory
        twice (ELOOP), and an image may have the same layer twice (`RUN
        true` twice). Its topmost place is kept: what the lower copy holds,
        the upper one shows above all between them, so the view is the same."""
        return list(dict.fromkeys(reversed(self.layers)))


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


def fresh_image_key(rootfs: Rootfs, spec: SandboxSpec) -> tuple[Path, ...] | None:
    """The layers of a sandbox's image if what a just-created sandbox finds
    in it can be remembered for the next ones (nsbox/init/users.py): image
    layers never change, and a new sandbox's writable layer is empty. Not
    with binds or tmpfs mounts, which may cover what it finds."""
    if spec.mounts or spec.tmpfs or not isinstance(rootfs, ImageRootfs):
        return None
    return rootfs.layers


def _hosts(hostname: str) -> str:
    return f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"


@functools.cache
def _fresh_etc() -> tuple[tuple[str, str, int], ...]:
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
    return (*identity, *[(f"{name}-", text, mode) for name, text, mode in identity], (".pwd.lock", "", 0o600))


