"""Overlay mounts of a sandbox's plan: its root and /etc are overlayfs over
read-only lower layers, with the writable upper layer on the host's disk
(the sandbox's layer directory, nsbox/host/layers.py) or in memory.
Used by the root filesystems (nsbox/plan/rootfs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from . import steps as s
from .plan import Phase, Plan

# The options every overlay of a sandbox gets besides its directories (see
# overlay()); `nsbox doctor` probes with them too.
OVERLAY_OPTIONS = "userxattr,volatile"
NOSUID_NODEV = ("MS_NOSUID", "MS_NODEV")


def overlay(plan: Plan, lowers: Sequence[Path], upper: Path, work: Path, target: str, what: str) -> None:
    """An overlayfs on `target` (MOUNT phase), its layers named through
    plan.host_dir. userxattr: overlayfs mounted inside a user namespace
    must keep its metadata in user.* xattrs; without it directory renames
    fail with EIO. volatile: a sandbox's writable layer does not outlive a
    host crash, so nothing it writes needs syncing; without it every
    unmount (every sandbox's end) syncs the whole host filesystem of the
    upper layer, flush included, and fsync inside the sandbox waits for
    the disk. The kernel then refuses to mount the same work dir again
    until the marker it leaves there is gone (layers.set_aside_work)."""
    if plan.writable is None or not plan.writable.layers:
        upper_dir, work_dir = plan.host_dir(upper), plan.host_dir(work)
    else:
        # The upper layer is on a size-capped tmpfs (nsbox/plan/resources.py);
        # what prepare() wrote into the layer directory is the top lower one.
        if any(upper.iterdir()):
            lowers = [upper, *lowers]
        upper_dir, work_dir = f"{plan.writable.path}/{upper.name}", f"{plan.writable.path}/{work.name}"
        plan.add(Phase.MOUNT, s.mkdir(upper_dir), s.mkdir(work_dir))
    _mount_overlay(plan, lowers, upper_dir, work_dir, target, what)


def memory_overlay(plan: Plan, lowers: Sequence[Path], name: str, target: str, what: str) -> None:
    """An overlayfs on `target` (MOUNT phase) as overlay() makes, but with
    its upper layer in memory: on the size-capped tmpfs of a limit,
    else on a tmpfs mounted on `target` itself, which the overlay then
    covers, so that nothing but the overlay reaches it. It ends with the
    sandbox's mount namespace: no work dir on a disk to make and delete."""
    if plan.writable is not None:
        base = f"{plan.writable.path}/{name}"
        plan.add(Phase.MOUNT, s.mkdir(base))
    else:
        base = target
        plan.add(Phase.MOUNT, s.mount("tmpfs", target, "tmpfs", NOSUID_NODEV, "mode=755",
                                      f"mount a tmpfs for the upper layer of {target}"))
    upper, work = f"{base}/upper", f"{base}/work"
    plan.add(Phase.MOUNT, s.mkdir(upper), s.mkdir(work))
    _mount_overlay(plan, lowers, upper, work, target, what)


def _mount_overlay(plan: Plan, lowers: Sequence[Path], upper: str, work: str, target: str, what: str) -> None:
    """The mount step of overlay() and memory_overlay(): `upper` and `work`
    as the child names them then, the lower layers through plan.host_dir."""
    data = f"lowerdir={':'.join(plan.host_dir(p) for p in lowers)},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}"
    plan.add(Phase.MOUNT, s.mount("overlay", target, "overlay", (), data, what))
