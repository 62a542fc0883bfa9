"""The on-disk list of live sandboxes, under the runtime directory.

Each sandbox has a directory <runtime>/<id>/ holding info.json and the
socket later clients connect to. Processes are identified by pid *and*
start time, so a recycled pid is never mistaken for a sandbox's owner or
init.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .dirs import runtime_dir, write_whole

INFO = "info.json"
SOCKET = "ctl.sock"


def read_start_time(pid: int) -> tuple[bytes, int]:
    """(state, start time in clock ticks since boot) of `pid`, a zombie
    too; OSError if it cannot be read (FileNotFoundError: no such process)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    # The command name (field 2) may contain spaces and ')'; field 3 is the
    # state and field 22 the start time.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])


def process_start_time(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot, or None if it is
    gone (or a zombie, which has finished running)."""
    try:
        state, start = read_start_time(pid)
    except OSError:
        return None
    return None if state in (b"Z", b"X") else start


_own: tuple[int, int | None] = (0, None)  # (pid, start time) of this process


def own_start_time() -> int | None:
    """This process's start time (read once per process, forks included)."""
    global _own
    if _own[0] != os.getpid():
        _own = (os.getpid(), process_start_time(os.getpid()))
    return _own[1]


def process_alive(pid: int, start_time: int | None) -> bool:
    return start_time is not None and process_start_time(pid) == start_time


@dataclass
class SandboxInfo:
    id: str
    owner_pid: int
    owner_start: int | None
    init_pid: int
    init_start: int | None
    rootfs: str
    layer: str
    hostname: str
    user: str
    workdir: str
    idmap: dict[str, Any]  # IdMap fields: mode, uid_map, gid_map, reason
    origin: str = "api"  # who created it: "api", "cli" or "inspect"
    label: str = ""  # free text for people, e.g. the Inspect sample
    created: float = field(default_factory=time.time)
    detached: bool = False
    network: str = "none"  # its network mode (a sandbox joining it gets the same)

    @property
    def owner_alive(self) -> bool:
        return process_alive(self.owner_pid, self.owner_start)

    @property
    def init_alive(self) -> bool:
        return process_alive(self.init_pid, self.init_start)


_FIELDS = {f.name for f in fields(SandboxInfo)}


def sandbox_dir(sandbox_id: str) -> Path:
    return runtime_dir() / sandbox_id


def remove_dir(d: Path) -> None:
    """A closed sandbox's directory: its entry and socket, then itself
    (kept if something else is left in it)."""
    for name in (INFO, SOCKET):
        try:
            os.unlink(d / name)
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
    except OSError:
        pass


def write(info: SandboxInfo) -> None:
    """Records `info` atomically (write_whole)."""
    # No indent: the C encoder (an indent takes the pure-Python one, ~0.1 ms).
    data = json.dumps({f.name: getattr(info, f.name) for f in fields(info)}).encode()
    write_whole(os.path.join(sandbox_dir(info.id), INFO), data)


def read(sandbox_id: str) -> SandboxInfo | None:
    try:
        data = json.loads((sandbox_dir(sandbox_id) / INFO).read_text())
        return SandboxInfo(**{k: v for k, v in data.items() if k in _FIELDS})  # another version's too
    except (OSError, ValueError, TypeError):
        return None


def entries() -> list[SandboxInfo]:
    """Every recorded sandbox, oldest first."""
    found = []
    for d in runtime_dir().iterdir():
        if d.is_dir() and not d.is_symlink():
            info = read(d.name)
            if info is not None:
                found.append(info)
    return sorted(found, key=lambda i: i.created)
