"""The filesystem contributor of a sandbox's plan (see nsbox/plan/plan.py): the
root filesystem, binds and tmpfs mounts, a fresh /proc, a minimal /dev and a
tmpfs /tmp.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from . import procmask, steps as s
from .plan import Phase, Plan

if TYPE_CHECKING:
    from ..spec import Bind, Tmpfs
    from .rootfs import Rootfs

# Host device nodes the sandbox gets, bind-mounted into a fresh /dev.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def contribute(plan: Plan, rootfs: Rootfs, layer: Path, mount_dir: Path, binds: Sequence[Bind],
               tmpfs: Sequence[Tmpfs] = ()) -> None:
    """The root is mounted on mount_dir/root, a directory of sandbox root's
    (see nsbox/host/layers.py mount_point())."""
    # Nothing we mount may propagate back to the host's mount namespace.
    plan.add(Phase.HOST, s.mount(None, "/", None, ("MS_REC", "MS_PRIVATE"), None, "make all mounts private"))
    # Device nodes cannot be created in a user namespace: take the host's.
    for dev in DEVICES:
        plan.add(Phase.HOST, s.tree_clone(f"/dev/{dev}", plan.slot(f"/dev/{dev}"), f"take the host's /dev/{dev}"))
    # A bind's source is resolved when the Bind is made (nsbox/spec.py):
    # a symlink found in it now was put there since, by a sandbox writing
    # where the source lies, and is not followed.
    for i, bind in enumerate(binds):
        plan.add(Phase.HOST, s.tree_clone(bind.source, plan.slot(f"bind{i}"),
                                          f"take a copy of {bind.source} (a symlink in it is refused)",
                                          recursive=True, readonly=bind.readonly, no_symlinks=True))
    # Crossing into the root once it is mounted needs a path through a
    # directory sandbox root may search: mount_dir is its own.
    plan.root = f"{plan.host_dir(mount_dir)}/root"
    rootfs.contribute(plan, layer)
    # The kernel mounts a new procfs only while a fully visible one exists
    # in the namespace, so /proc is mounted before the host's goes away.
    proc = f"{plan.root}/proc"
    plan.add(Phase.MOUNT, s.mkdir(proc, 0o555))
    procmask.mount_proc(plan, proc)  # or, where the host's /proc is masked, a bind of it
    # From here on every path is inside the sandbox: a symlink in the root
    # filesystem can only lead somewhere else inside it.
    # An image keeps its own /tmp, as in Docker (ImageRootfs.tmpfs_tmp).
    _dev_tmp(plan, tmpfs_tmp=rootfs.tmpfs_tmp)
    # The user's mounts, a parent before what is mounted under it (as Docker
    # orders them): given the other way round, it would hide them.
    user: list[tuple[str, Callable[[], None]]] = [
        *((b.target, functools.partial(_attach_bind, plan, b, plan.slot(f"bind{i}"))) for i, b in enumerate(binds)),
        *((t.target, functools.partial(_mount_tmpfs, plan, t, i)) for i, t in enumerate(tmpfs))]
    for _, attach in sorted(user, key=lambda m: m[0].strip("/").count("/")):
        attach()


def _dev_tmp(plan: Plan, tmpfs_tmp: bool = True) -> None:
    # Under a limit, few inodes too: empty files take no blocks but memory.
    dev = "mode=755,size=1m" + (",nr_inodes=1024" if plan.writable else "")
    plan.add(Phase.INSIDE, s.mkdir("/dev"),
             s.mount("tmpfs", "/dev", "tmpfs", ("MS_NOSUID", "MS_NOEXEC"), dev, "mount a tmpfs on /dev"))
    for dev in DEVICES:
        plan.add(Phase.INSIDE, s.mkfile(f"/dev/{dev}"),
                 s.tree_attach(plan.slot(f"/dev/{dev}"), f"/dev/{dev}", f"attach /dev/{dev}"))
    # A private devpts instance; group tty (5) owns ptys when it is mapped.
    pts = "newinstance,ptmxmode=0666,mode=620" + (",gid=5" if plan.idmap.size > 5 else "")
    plan.add(
        Phase.INSIDE,
        s.mkdir("/dev/pts"),
        s.mount("devpts", "/dev/pts", "devpts", ("MS_NOSUID", "MS_NOEXEC"), pts, "mount a private devpts"),
        s.symlink("pts/ptmx", "/dev/ptmx"),
        s.mkdir("/dev/shm"),
        s.symlink("/proc/self/fd", "/dev/fd"),
        s.symlink("/proc/self/fd/0", "/dev/stdin"),
        s.symlink("/proc/self/fd/1", "/dev/stdout"),
        s.symlink("/proc/self/fd/2", "/dev/stderr"),
    )
    plan.tmpfs("/dev/shm", 0o1777, "mount a tmpfs on /dev/shm")
    if tmpfs_tmp:
        plan.add(Phase.INSIDE, s.mkdir("/tmp"))
        plan.tmpfs("/tmp", 0o1777, "mount a tmpfs on /tmp")


def _mount_point(plan: Plan, target: str, directory: bool) -> str:
    """Creates the user's mount point `target` (and missing parents) where
    it leads inside the root, as Docker does: through an image's symlinks
    (`/var/run/x` is `/run/x` on Debian); its normal form."""
    if target.strip("/") == "":
        return "/"  # the root (a working directory of "/"): there
    parts = target.strip("/").split("/")
    for i in range(1, len(parts)):
        plan.add(Phase.INSIDE, s.mkdir("/" + "/".join(parts[:i]), in_root=True))
    target = "/" + "/".join(parts)
    plan.add(Phase.INSIDE, s.mkdir(target, in_root=True) if directory else s.mkfile(target, in_root=True))
    return target


def _mount_tmpfs(plan: Plan, tmpfs: Tmpfs, i: int) -> None:
    target = _mount_point(plan, tmpfs.target, directory=True)
    plan.tmpfs(target, tmpfs.mode, f"mount a tmpfs on {target}", size=tmpfs.size, readonly=tmpfs.readonly,
               noexec=tmpfs.noexec, name=f"-user{i}", in_root=True)


def _attach_bind(plan: Plan, bind: Bind, slot: int) -> None:
    """Creates the mount point and attaches the bind."""
    target = _mount_point(plan, bind.target, directory=Path(bind.source).is_dir())
    plan.add(Phase.INSIDE, s.tree_attach(slot, target, f"attach {bind.source} at {target}", in_root=True))


def read_only(plan: Plan, rootfs: Rootfs, workdir: str | None, network: str) -> None:
    """The root's own mounts made read-only, as Docker's --read-only: the
    mounts on it (binds, tmpfs, /dev, /proc, the host-composed root's /tmp
    and /run) stay as they are. The /etc files nsbox writes once the
    sandbox runs (/etc/hosts; resolv.conf where the network may be nat's:
    nat, a service network, another's) stay writable as
    binds of themselves, and the working directory is made first (Docker's
    runtime makes it too; read-only, nsbox could not later)."""
    if workdir is not None:
        _mount_point(plan, workdir, directory=True)
    kept = ["/etc/hosts", *(["/etc/resolv.conf"] if network not in ("none", "host", "proxy") else [])]
    plan.add(Phase.INSIDE, s.mkdir("/etc"))
    for path in kept:
        slot = plan.slot(f"read-only:{path}")
        plan.add(Phase.INSIDE, s.mkfile(path), s.tree_clone(path, slot, f"keep {path} writable"),
                 s.tree_attach(slot, path, f"keep {path} writable"))
    for target in rootfs.own_mounts:
        plan.add(Phase.INSIDE, s.remount(target, ("MS_BIND", "MS_RDONLY"), f"make {target} read-only"))
