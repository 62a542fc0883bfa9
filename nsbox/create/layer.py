"""A sandbox's writable layer: made before the clone, released after.

Its directories are its root filesystem's (nsbox/plan/rootfs.py, which
takes a layer kept from an earlier sandbox where it can), with the /etc
files its network needs (nsbox/create/netattach.py). Once nothing runs in
the sandbox, the layer is kept for the next sandbox if it is untouched,
else deleted (nsbox/host/layers.py; nsbox/create/unshare.py for files of
subordinate ids), on this process's sweeper thread (nsbox/host/removal.py).
"""

from __future__ import annotations

import errno
import functools
import sys
import time
from pathlib import Path

from ..errors import NsboxError, describe
from ..host import layers, removal
from ..host.idmap import IdMap
from ..plan.rootfs import Rootfs
from . import unshare
from .netattach import NetAttachment


def path(sandbox_id: str) -> Path:
    return layers.layers_dir() / sandbox_id


def prepare(layer: Path, rootfs: Rootfs, hostname: str, mapping: IdMap, network: NetAttachment) -> None:
    rootfs.prepare(layer, hostname, mapping.host_root)
    network.prepare_layer(rootfs, layer, mapping.host_root)


def release_later(sandbox_id: str, layer: Path, rootfs: Rootfs, mapping: IdMap) -> None:
    """Hands the layer of a sandbox in which nothing runs any more to the
    sweeper's thread, which keeps it for reuse or deletes it while this
    process goes on (removal.wait_swept waits for it)."""
    removal.release_later(functools.partial(_release, sandbox_id, layer, rootfs, mapping))


def _release(sandbox_id: str, layer: Path, rootfs: Rootfs, mapping: IdMap) -> None:
    """Keeps the layer of a closed sandbox for the next one if it is
    untouched (a few syscalls), else deletes it, as long as that takes.
    Out of descriptors (a thousand sandboxes closing at once hold many for
    a moment), it waits and tries again, up to OUT_OF_DESCRIPTORS_WAIT s."""
    deadline = time.monotonic() + OUT_OF_DESCRIPTORS_WAIT
    while True:
        try:
            _release_once(layer, rootfs, mapping)
            return
        except (OSError, NsboxError) as e:
            if _out_of_descriptors(e) and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            print(f"nsbox: could not delete the writable layer of sandbox {sandbox_id} ({layer}): {describe(e)}; "
                  "`nsbox gc` tries again", file=sys.stderr)
            return


OUT_OF_DESCRIPTORS_WAIT = 30.0


def _out_of_descriptors(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def _release_once(layer: Path, rootfs: Rootfs, mapping: IdMap) -> None:
    aside = layers.set_aside_work(layer)
    if aside and rootfs.release_layer(layer, mapping.host_root):
        return
    if layers.remove_untouched_layer(layer):
        return
    unshare.remove_layer(layer, mapping)
