"""Managing sandboxes from outside their owner: list, remove, collect garbage.

Used by `nsbox ps / rm / gc` and by `inspect sandbox cleanup nsbox`. A
sandbox is found through the live-sandbox list (nsbox/host/live.py); it is
removed by killing its init (which takes every process of the sandbox with
it), then deleting its writable layer and its live entry. Each sandbox and
layer is handled on its own: one that cannot be removed is reported, in one
line, and the others are still removed.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .init import client
from .host import dirs, live
from .plan import resources
from .errors import NsboxError, describe
from .host.idmap import IdMap
from .host.idmap import detect as detect_idmap
from .host.live import SandboxInfo
from .create.unshare import remove_layer
from .host.removal import SWEEP_WAIT, wait_swept
from .host.layers import REUSE, TRASH

# A layer directory without a live entry may belong to a sandbox being
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
    return client.query_status(os.fspath(live.sandbox_dir(info.id) / live.SOCKET))


def entries(with_status: bool = False) -> list[Entry]:
    out = []
    for info in live.entries():
        st = state_of(info)
        status = query_status(info) if with_status and st != "dead" else None
        out.append(Entry(info, st, status["execs"] if status else None))
    return out


def find(prefix: str) -> SandboxInfo:
    """The sandbox whose id starts with `prefix` (as docker accepts)."""
    matches = [i for i in live.entries() if i.id.startswith(prefix)]
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
        # poll, not select: select refuses descriptors above 1023.
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(KILL_WAIT * 1000):
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
    resources.remove_cgroups(live.sandbox_dir(info.id))
    layer = Path(info.layer)
    try:
        remove_layer(layer, _mapping_of(info))
    except Exception as e:  # whatever it is, say which layer and sandbox
        # The entry stays, so that `nsbox ps` shows it and gc tries again.
        raise NsboxError(f"cannot remove layer {layer} of sandbox {info.id}: {describe(e)}") from e
    run = live.sandbox_dir(info.id)
    for name in (live.INFO, live.SOCKET, live.INFO + dirs.PARTIAL):
        try:
            os.unlink(run / name)
        except FileNotFoundError:
            pass
    try:
        run.rmdir()
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise


def failure(sandbox_id: str, e: Exception) -> str:
    """Why `sandbox_id` could not be removed, in one line."""
    return describe(e) if isinstance(e, NsboxError) else f"cannot remove sandbox {sandbox_id}: {describe(e)}"


def garbage() -> tuple[list[SandboxInfo], list[Path]]:
    """What gc would remove: sandboxes that are dead or whose owner is gone
    without detaching them, and layers no sandbox refers to."""
    recorded = live.entries()
    infos = [i for i in recorded if state_of(i) in ("dead", "orphaned")]
    known = {Path(i.layer) for i in recorded}
    running = running_inits()  # those a shell with another runtime directory made too
    layers_dir = dirs.data_dir() / "sandboxes"
    orphans = []
    now = time.time()
    for layer in _listdir(layers_dir):
        if layer.name == REUSE:
            orphans += _listdir(layer)  # kept for reuse: garbage to gc
            continue
        if layer.name == TRASH:
            orphans += _listdir(layer)  # left by a sweeper that did not finish
            continue
        try:
            age = now - layer.lstat().st_mtime
        except FileNotFoundError:
            continue  # removed meanwhile
        if layer not in known and layer.name not in running and age > ORPHAN_LAYER_AGE:
            orphans.append(layer)
    return infos, orphans


def running_inits() -> set[str]:
    """The ids of the sandboxes whose init runs, as their command lines say
    (`nsbox-init ID`), whichever runtime directory lists them. A process
    inside a sandbox may take such a name: it can only keep a layer."""
    ids = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read(64).split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if len(argv) > 1 and argv[0] == b"nsbox-init":
            ids.add(argv[1].decode(errors="replace"))
    return ids


def _listdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except FileNotFoundError:
        return []


@dataclass
class GcReport:
    sandboxes: list[str] = field(default_factory=list)  # ids of the sandboxes removed
    layers: list[Path] = field(default_factory=list)  # stray layers removed
    volumes: list[Path] = field(default_factory=list)  # compose samples' volumes no one uses
    failures: list[str] = field(default_factory=list)  # one line each: what could not be removed, and why


def gc(mapping: IdMap) -> GcReport:
    """Removes the garbage, each piece on its own: one that cannot be
    removed is reported and does not stop the others."""
    wait_swept(SWEEP_WAIT)  # this process's closed sandboxes first: their layers are not garbage
    report = GcReport()
    infos, orphans = garbage()
    for info in infos:
        try:
            remove(info, force=True)
            report.sandboxes.append(info.id)
        except Exception as e:  # whatever it is, the rest is still collected
            report.failures.append(failure(info.id, e))
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
        try:
            remove_layer(layer, mapping)
            report.layers.append(layer)
        except Exception as e:
            report.failures.append(f"cannot remove layer {layer}: {describe(e)}")
    for volumes in orphan_volumes():
        try:
            remove_volumes(volumes, mapping)
            report.volumes.append(volumes)
        except Exception as e:
            report.failures.append(f"cannot remove volumes {volumes}: {describe(e)}")
    _remove_partial_records()
    return report


def collect_dead() -> list[str]:
    """Removes this user's sandboxes that nothing will remove any more:
    their init and their owner process are both gone (a killed eval's,
    say). A live sandbox, and a dead one whose owner still runs (it closes
    its own), are never touched. Each is claimed with a lock on its
    runtime directory, so that processes collecting at once do not remove
    the same one; what fails is left for `nsbox gc`, which reports it."""
    removed = []
    for info in live.entries():
        if _stop_collecting.is_set():
            break  # the process is exiting: the rest is the next one's
        if info.init_alive or info.owner_alive:
            continue
        try:
            fd = os.open(live.sandbox_dir(info.id), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if live.read(info.id) is not None:  # else removed before we held the lock
                remove(info, force=True)
                removed.append(info.id)
        except Exception:
            pass  # another process holds it, or it cannot be removed: `nsbox gc` says why
        finally:
            os.close(fd)
    if not _stop_collecting.is_set():
        remove_orphan_volumes()  # a killed eval's compose volumes
    return removed


# ---- compose samples' named volumes -----------------------------------
#
# <data>/volumes/<project>-<hex>/ holds one sample's named volumes, and
# <project>-<hex>.sandboxes says who uses them: the process that made them
# (written before the directory), then the sample's sandboxes (kept ones,
# --no-sandbox-cleanup, outlive that process). Once they are gone, the
# volumes are garbage: a killed eval's are removed by the next collection.

def volume_base() -> Path:
    """Where samples' named volumes live: on disk, as Docker's do."""
    return dirs.data_dir() / "volumes"


def _users_file(volumes: Path) -> Path:
    return volumes.with_name(volumes.name + ".sandboxes")


def record_volume_users(volumes: Path, sandbox_ids: list[str]) -> None:
    """Says who uses `volumes`: this process, and its sandboxes
    `sandbox_ids`, by their inits (pid and start time: the live registry
    is under the runtime directory, which another shell may not share)."""
    inits = [(i, info.init_pid, info.init_start) for i in sandbox_ids if (info := live.read(i)) is not None]
    own = {"owner": [os.getpid(), live.own_start_time()], "sandboxes": inits}
    dirs.write_whole(os.fspath(_users_file(volumes)), json.dumps(own).encode())


def remove_volumes(volumes: Path, mapping: IdMap) -> None:
    if volumes.exists():
        remove_layer(volumes, mapping)
    _users_file(volumes).unlink(missing_ok=True)


def orphan_volumes() -> list[Path]:
    """The samples' volumes that neither their maker nor any of their
    sandboxes uses any more."""
    base = volume_base()
    gone = []
    for users in base.glob("*.sandboxes") if base.is_dir() else ():
        try:
            rec = json.loads(users.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, list):  # an older version's: the sandboxes' ids alone
            rec = {"owner": [0, None], "sandboxes": [[i, info.init_pid, info.init_start] for i in rec
                                                     if (info := live.read(str(i))) is not None]}
        try:
            owner_alive = live.process_alive(int(rec["owner"][0]), rec["owner"][1])
            inits_alive = [live.process_alive(int(pid), start) for _, pid, start in rec["sandboxes"]]
        except (KeyError, TypeError, ValueError):
            continue
        # Until the sample's sandboxes are recorded, its maker uses them; then
        # they do (kept ones outlive the maker; its close removes the rest).
        if any(inits_alive) if inits_alive else owner_alive:
            continue
        gone.append(users.with_name(users.name.removesuffix(".sandboxes")))
    return gone


def remove_orphan_volumes(mapping: IdMap | None = None) -> list[Path]:
    """Deletes orphan_volumes(); returns what it deleted."""
    gone = orphan_volumes()
    for volumes in gone:
        remove_volumes(volumes, mapping or detect_idmap())
    _remove_partial_records()
    return gone


def _remove_partial_records() -> None:
    """The parts of volume records whose writer was killed."""
    base = volume_base()
    for partial in base.glob("*.sandboxes" + dirs.PARTIAL) if base.is_dir() else ():
        dirs.remove_stale_partial(os.fspath(partial))


_collector: tuple[int, threading.Thread] | None = None  # (pid, thread): once per process
_stop_collecting = threading.Event()


def _collect_quietly() -> None:
    # Whatever stops it (a state directory refused, say) is said by the
    # sandbox's own use of the same directories, or by `nsbox gc`.
    try:
        collect_dead()
    except Exception:
        pass


def _finish_collecting(thread: threading.Thread) -> None:
    """At exit: the sandbox being removed is finished, the rest left, so
    that the thread is not cut off by the interpreter's shutdown."""
    _stop_collecting.set()
    thread.join()


def collect_in_background() -> None:
    """collect_dead() once per process, on a thread of its own, so that a
    sandbox's creation does not wait for it. A process that exits first
    leaves the rest to the next one (a layer is removed before its entry)."""
    global _collector
    if _collector is not None and _collector[0] == os.getpid():
        return
    _stop_collecting.clear()
    thread = threading.Thread(target=_collect_quietly, name="nsbox-collect", daemon=True)
    _collector = (os.getpid(), thread)
    thread.start()
    atexit.register(_finish_collecting, thread)


def wait_collected(timeout: float) -> bool:
    """Whether this process's collect_in_background() is done within `timeout` s."""
    if _collector is None or _collector[0] != os.getpid():
        return True
    _collector[1].join(timeout)
    return not _collector[1].is_alive()
