"""Managing sandboxes from outside their owner: list, remove, collect garbage.

Used by `nsbox ps / rm / gc` and by `inspect sandbox cleanup nsbox`. A
sandbox is found through the registry (nsbox/registry.py); it is removed by
killing its init (which takes every process of the sandbox with it), then
deleting its writable layer and its registry entry.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from . import dirs, protocol, registry
from .errors import NsboxError
from .idmap import IdMap
from .idmap import detect as detect_idmap
from .registry import SandboxInfo
from .rootfs import REUSE, remove_layer

# A layer directory without a registry entry may belong to a sandbox being
# created right now; only older ones are garbage.
ORPHAN_LAYER_AGE = 60.0
KILL_WAIT = 5.0


@dataclass(frozen=True)
class Entry:
    info: SandboxInfo
    state: str  # "running", "detached", "orphaned" (owner gone), "dead" (init gone)
    execs: int | None  # commands served, when the init answered


def state_of(info: SandboxInfo) -> str:
    if not info.init_alive:
        return "dead"
    if info.detached:
        return "detached"
    return "running" if info.owner_alive else "orphaned"


def query_status(info: SandboxInfo) -> dict[str, int] | None:
    """Asks the init for its counters over the sandbox's socket."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(1.0)
            s.connect(os.fspath(registry.sandbox_dir(info.id) / registry.SOCKET))
            s.send(protocol.REQUEST.pack(protocol.OP_STATUS, *[0] * 9))
            _, running, execs, detached, _ = protocol.STATUS.unpack(s.recv(protocol.STATUS.size))
            return {"running": running, "execs": execs, "detached": detached}
    except (OSError, struct.error):
        return None


def entries(with_status: bool = False) -> list[Entry]:
    out = []
    for info in registry.entries():
        st = state_of(info)
        status = query_status(info) if with_status and st != "dead" else None
        out.append(Entry(info, st, status["execs"] if status else None))
    return out


def find(prefix: str) -> SandboxInfo:
    """The sandbox whose id starts with `prefix` (as docker accepts)."""
    matches = [i for i in registry.entries() if i.id.startswith(prefix)]
    if not matches:
        raise NsboxError(f"no sandbox {prefix!r}", hint="run `nsbox ps` to list them")
    if len(matches) > 1:
        raise NsboxError(f"{prefix!r} matches several sandboxes: {', '.join(m.id for m in matches)}")
    return matches[0]


def _kill_init(info: SandboxInfo) -> None:
    try:
        pidfd = os.pidfd_open(info.init_pid)
    except ProcessLookupError:
        return
    try:
        # The pid may have been recycled since we looked: check through the
        # pidfd, which pins the process it was opened for.
        if not info.init_alive:
            return
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        if not select.select([pidfd], [], [], KILL_WAIT)[0]:
            raise NsboxError(f"sandbox {info.id}: its init (pid {info.init_pid}) did not exit after SIGKILL")
    finally:
        os.close(pidfd)
    # Our own child (the owner is this process): reap it.
    try:
        os.waitpid(info.init_pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _mapping_of(info: SandboxInfo) -> IdMap:
    """The id mapping the sandbox had (an entry written by an older nsbox
    may not record it: then this user's current one)."""
    try:
        return IdMap.from_dict(info.idmap)
    except (TypeError, KeyError, ValueError):
        return detect_idmap()


def remove(info: SandboxInfo, *, force: bool = False) -> None:
    """Kills the sandbox's processes, deletes its layer and its entry.

    A sandbox whose owning process is alive (and did not detach it) is only
    removed with force=True: its owner is still using it.
    """
    if not force and state_of(info) == "running" and info.owner_pid != os.getpid():
        raise NsboxError(f"sandbox {info.id} belongs to the running process {info.owner_pid}",
                         hint="stop that process, or use --force")
    _kill_init(info)
    layer = Path(info.layer)
    if layer.exists():
        remove_layer(layer, _mapping_of(info))
    run = registry.sandbox_dir(info.id)
    for name in (registry.INFO, registry.SOCKET, registry.INFO + ".tmp"):
        try:
            os.unlink(run / name)
        except FileNotFoundError:
            pass
    try:
        run.rmdir()
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise


def garbage() -> tuple[list[SandboxInfo], list[Path]]:
    """What gc would remove: sandboxes that are dead or whose owner is gone
    without detaching them, and layers no sandbox refers to."""
    infos = [i for i in registry.entries() if state_of(i) in ("dead", "orphaned")]
    known = {Path(i.layer) for i in registry.entries()}
    layers_dir = dirs.data_dir() / "sandboxes"
    orphans = []
    if layers_dir.exists():
        now = time.time()
        for layer in layers_dir.iterdir():
            if layer.name == REUSE:
                orphans += list(layer.iterdir())  # kept for reuse: garbage to gc
            elif layer not in known and now - layer.lstat().st_mtime > ORPHAN_LAYER_AGE:
                orphans.append(layer)
    return infos, orphans


def gc(mapping: IdMap) -> tuple[list[str], list[Path]]:
    """Removes the garbage; returns the sandbox ids and stray layers removed."""
    infos, orphans = garbage()
    for info in infos:
        remove(info, force=True)
    removed = []
    for layer in orphans:
        if layer.parent.name == REUSE:
            # Take it out of the pool first (atomically), so that a sandbox
            # being created cannot pick up a half-deleted layer.
            taken = layer.parent.parent / f".gc-{layer.name}"
            try:
                os.rename(layer, taken)
            except OSError:
                continue  # a new sandbox took it
            layer = taken
        remove_layer(layer, mapping)
        removed.append(layer)
    return [i.id for i in infos], removed
