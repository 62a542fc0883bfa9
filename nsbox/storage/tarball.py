"""Unpacking a root filesystem tarball into a directory usable as a rootfs.

The files must end up owned by ids mapped into this user's sandboxes (or
overlayfs cannot copy them up), so the archive is unpacked by `tar` running
*inside* a sandbox with the user's id mapping (made by the caller's runner,
storage/confined.py). That sandbox sees only the
host-composed root, the tarball (read-only) and the destination: a hostile
archive (absolute paths, '..', symlinks pointing out) can at worst write
into the destination or the throwaway sandbox, never elsewhere on the host.

In single-uid mode every file becomes the user's (sandbox root's): that is
all such a sandbox can represent.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable

from ..host import idmap
from ..errors import NsboxError
from ..host.removal import remove_layer
from ..plan.rootfs import Bind
from .confined import Runner


async def import_tarball(
    tarball: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    runner: Runner,
    id_mapping: idmap.Requested = "auto",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Unpacks `tarball` (any compression GNU tar knows) into `dest`, in a
    sandbox `runner` makes.

    `dest` must not exist; it appears only once the archive is complete, so
    an interrupted import leaves nothing half-written behind.
    """
    src = Path(tarball).resolve()
    target = Path(dest).absolute()
    if not src.is_file():
        raise NsboxError(f"image {src} is not a file")
    if target.exists():
        raise NsboxError(f"{target} already exists", hint="remove it first, or choose another destination")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / f".{target.name}.partial-{secrets.token_hex(4)}"
    work.mkdir(mode=0o755)
    # Sandbox root unpacks into it: as real root that is not us.
    mapping = idmap.detect(id_mapping)
    if mapping.host_root != (os.geteuid(), os.getegid()):
        os.chown(work, *mapping.host_root)
    box = runner([Bind(os.fspath(work), "/target"), Bind(os.fspath(src), "/image", readonly=True)],
                 id_mapping=id_mapping)
    try:
        async with box:
            single = mapping.mode == "single"
            owner = ["--no-same-owner"] if single else ["--same-owner", "--numeric-owner"]
            if progress:
                progress(f"unpacking {src} ({src.stat().st_size / 1e6:.0f} MB) into {target}")
            r = await box.exec(["tar", "-x", "-p", *owner, "-f", "/image", "-C", "/target"])
            if not r.success:
                raise NsboxError(f"unpacking {src} failed: {r.stderr.strip()[-2000:]}")
            # The unpacked root, not the mount point, decides the mode of "/".
            await box.exec(["chmod", "755", "/target"])
        os.rename(work, target)
    except BaseException:
        remove_layer(work, mapping)
        raise
    return target
