"""Which uid/gid maps this user's sandboxes get, and why.

Sandbox uid 0 is always the invoking user. Beyond that, three modes:

- "root":   nsbox runs as real root and writes the maps itself: sandbox ids
            0..65535 are the host's ids 0..65535.
- "subuid": newuidmap/newgidmap exist and /etc/subuid and /etc/subgid give
            this user a range: sandbox ids 1..N map onto it (the podman
            convention), so other users exist inside the sandbox.
- "single": only the user's own uid and gid are mapped; running as any other
            user is impossible, and `reason` says why and how to fix it.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
from dataclasses import dataclass
from typing import Literal


Mode = Literal["root", "subuid", "single"]

# How many ids the root mode maps (0..65535, nobody and nogroup included).
ROOT_RANGE = 65536
SUBID_HELPERS = ("newuidmap", "newgidmap")
SEARCH_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


@dataclass(frozen=True)
class IdMap:
    mode: Mode
    uid_map: tuple[tuple[int, int, int], ...]  # (inside, outside, count)
    gid_map: tuple[tuple[int, int, int], ...]
    reason: str  # why this mode, in words

    @property
    def size(self) -> int:
        """Sandbox uids 0..size-1 are mapped."""
        return min(sum(c for _, _, c in self.uid_map), sum(c for _, _, c in self.gid_map))

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "uid_map": self.uid_map, "gid_map": self.gid_map, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> "IdMap":
        def lines(v: object) -> tuple[tuple[int, int, int], ...]:
            return tuple(tuple(int(x) for x in line) for line in v)  # type: ignore[misc, union-attr, attr-defined]
        return cls(d["mode"], lines(d["uid_map"]), lines(d["gid_map"]), str(d["reason"]))  # type: ignore[arg-type]

    def nested_identity(self) -> tuple[str, str]:
        """uid_map and gid_map text of a user namespace nested in one with
        this mapping, mapping every id to itself: one line per extent, since
        the kernel refuses an extent that spans two of the outer map's."""
        return (_format(tuple((i, i, c) for i, _, c in self.uid_map)),
                _format(tuple((i, i, c) for i, _, c in self.gid_map)))

    def how_to_write(self) -> tuple[str, str, str | None, str | None, bool]:
        """(uid_map, gid_map, newuidmap, newgidmap, deny_setgroups) for
        nsbox-create, which writes the maps of each new sandbox."""
        helpers = (_find(SUBID_HELPERS[0]), _find(SUBID_HELPERS[1])) if self.mode == "subuid" else (None, None)
        return _format(self.uid_map), _format(self.gid_map), helpers[0], helpers[1], self.mode == "single"


def _format(lines: tuple[tuple[int, int, int], ...]) -> str:
    return "".join(f"{i} {o} {c}\n" for i, o, c in lines)


@functools.cache
def _find(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path=SEARCH_PATH)


def _subid_range(path: str, name: str, uid: int) -> tuple[int, int] | None:
    """The first range /etc/subuid (or subgid) gives this user, if any."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.strip().split(":")
                if len(parts) != 3 or parts[0] not in (name, str(uid)):
                    continue
                try:
                    start, count = int(parts[1]), int(parts[2])
                except ValueError:
                    continue
                if count > 0:
                    return start, count
    except OSError:
        return None
    return None


SINGLE_FIX = (
    "to run as other users, give {name} a subordinate id range and install newuidmap: "
    "as root, `usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {name}` "
    "and `apt-get install uidmap` (or your distribution's shadow-utils)"
)


_detected: dict[tuple[object, ...], IdMap] = {}


def detect(requested: Literal["auto", "single"] = "auto") -> IdMap:
    """The best mapping available to the current user (remembered until
    /etc/subuid or /etc/subgid change)."""
    def stamp(path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    key = (os.geteuid(), os.getegid(), requested, stamp("/etc/subuid"), stamp("/etc/subgid"))
    if key not in _detected:
        _detected[key] = _detect(requested)
    return _detected[key]


def _detect(requested: Literal["auto", "single"]) -> IdMap:
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    single = (((0, uid, 1),), ((0, gid, 1),))

    if requested == "single":
        return IdMap("single", *single, reason="a single id was requested (id_mapping: single)")
    if uid == 0:
        full = ((0, 0, ROOT_RANGE),)
        return IdMap("root", full, full, reason="running as root")

    fix = SINGLE_FIX.format(name=name)
    subuid = _subid_range("/etc/subuid", name, uid)
    subgid = _subid_range("/etc/subgid", name, uid)
    if subuid is None or subgid is None:
        which = "/etc/subuid" if subuid is None else "/etc/subgid"
        return IdMap("single", *single, reason=f"{which} has no range for {name}; {fix}")
    missing = [t for t in SUBID_HELPERS if _find(t) is None]
    if missing:
        return IdMap("single", *single, reason=f"{' and '.join(missing)} not found; {fix}")
    return IdMap(
        "subuid",
        ((0, uid, 1), (1, subuid[0], subuid[1])),
        ((0, gid, 1), (1, subgid[0], subgid[1])),
        reason=f"{name} has subordinate ids {subuid[0]}..{subuid[0] + subuid[1] - 1}",
    )
