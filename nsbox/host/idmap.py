"""Which uid/gid maps this user's sandboxes get, and why.

Sandbox uid 0 is always the invoking user. Beyond that, three modes:

- "root":   nsbox runs as real root and writes the maps itself, onto a
            subordinate range as podman does: sandbox ids 0..65535 are host
            ids S..S+65535, S from root's /etc/subuid and /etc/subgid entries,
            else ROOT_DEFAULT_BASE. Host root is never mapped, so sandbox root
            cannot read files only host root may read, and host setuid-root
            binaries do nothing inside. id_mapping="host-root" maps host ids
            0..65535 onto themselves instead (an explicit opt-in).
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

from ..errors import NsboxError

Mode = Literal["root", "subuid", "single"]

# How many ids the root mode maps (0..65535, nobody and nogroup included).
ROOT_RANGE = 65536
# Where root's sandboxes map when root has no /etc/subuid range: far above
# the ids distributions hand out to users and to subordinate ranges.
ROOT_DEFAULT_BASE = 1_000_000_000
Requested = Literal["auto", "single", "host-root"]
REQUESTS = ("auto", "single", "host-root")
SUBID_HELPERS = ("newuidmap", "newgidmap")
SEARCH_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


@dataclass(frozen=True)
class IdMaps:
    """How nsbox-create writes a new user namespace's maps (the fields of
    struct nsbox_clone_request of the same names): the maps as
    /proc/PID/uid_map takes them; for a subordinate range, the setuid
    helpers that write them (else they are written directly); whether
    setgroups is denied first, as it must be to map a single gid."""

    uid_map: str
    gid_map: str
    newuidmap: str | None = None
    newgidmap: str | None = None
    deny_setgroups: bool = False


@dataclass(frozen=True)
class IdMap:
    mode: Mode
    uid_map: tuple[tuple[int, int, int], ...]  # (inside, outside, count)
    gid_map: tuple[tuple[int, int, int], ...]
    reason: str  # why this mode, in words

    @property
    def host_root(self) -> tuple[int, int]:
        """The host uid and gid that sandbox root is."""
        return self.uid_map[0][1], self.gid_map[0][1]

    @property
    def key(self) -> str:
        """Names this mapping in cache keys: files unpacked for one mapping
        have the wrong owners under another."""
        return f"{self.mode}-{self.uid_map[0][1]}" + ("" if self.mode == "single" else f"-{self.uid_map[-1][1]}")

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

    def how_to_write(self) -> IdMaps:
        """How nsbox-create writes the maps of each new sandbox."""
        helpers = (_find(SUBID_HELPERS[0]), _find(SUBID_HELPERS[1])) if self.mode == "subuid" else (None, None)
        return IdMaps(_format(self.uid_map), _format(self.gid_map), newuidmap=helpers[0], newgidmap=helpers[1],
                      deny_setgroups=self.mode == "single")


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


def detect(requested: Requested = "auto") -> IdMap:
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


def _detect(requested: Requested) -> IdMap:
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    single = (((0, uid, 1),), ((0, gid, 1),))

    if requested == "single":
        return IdMap("single", *single, reason="a single id was requested (id_mapping: single)")
    if requested == "host-root" and uid != 0:
        raise NsboxError("id_mapping 'host-root' maps host root into the sandbox: only root can ask for it")
    if uid == 0 and not _initial_user_namespace():
        return _namespace_root()
    if uid == 0:
        if requested == "host-root":
            full = ((0, 0, ROOT_RANGE),)
            return IdMap("root", full, full, reason="running as root, host root mapped (id_mapping: host-root)")
        return _root_range()

    fix = SINGLE_FIX.format(name=name)
    subuid = _subid_range("/etc/subuid", name, uid)
    subgid = _subid_range("/etc/subgid", name, uid)
    if subuid is None or subgid is None:
        which = "/etc/subuid" if subuid is None else "/etc/subgid"
        return IdMap("single", *single, reason=f"{which} has no range for {name}; {fix}")
    missing = [t for t in SUBID_HELPERS if _find(t) is None]
    if missing:
        return IdMap("single", *single, reason=f"{' and '.join(missing)} not found; {fix}")
    if _no_new_privs():
        # newuidmap is setuid: under no_new_privs (Kubernetes'
        # allowPrivilegeEscalation: false, `setpriv --no-new-privs`) it
        # cannot write the maps.
        return IdMap("single", *single, reason="no_new_privs is set for this process, so the setuid newuidmap "
                                               "cannot run (Kubernetes: allowPrivilegeEscalation: true)")
    return IdMap(
        "subuid",
        ((0, uid, 1), (1, subuid[0], subuid[1])),
        ((0, gid, 1), (1, subgid[0], subgid[1])),
        reason=f"{name} has subordinate ids {subuid[0]}..{subuid[0] + subuid[1] - 1}",
    )


def _root_range() -> IdMap:
    """Real root's sandboxes: ids 0..65535 on a subordinate range."""
    subuid = _subid_range("/etc/subuid", "root", 0)
    subgid = _subid_range("/etc/subgid", "root", 0)
    if subuid and subgid and subuid[1] >= ROOT_RANGE and subgid[1] >= ROOT_RANGE:
        where = "root's /etc/subuid and /etc/subgid ranges"
        ubase, gbase = subuid[0], subgid[0]
    else:
        ubase = gbase = ROOT_DEFAULT_BASE
        where = f"the built-in range (root has no /etc/subuid range of {ROOT_RANGE} ids)"
        for path in ("/etc/subuid", "/etc/subgid"):
            clash = _overlapping_range(path, ROOT_DEFAULT_BASE, ROOT_RANGE)
            if clash:
                raise NsboxError(
                    f"nsbox's default id range for root's sandboxes ({ROOT_DEFAULT_BASE}..."
                    f"{ROOT_DEFAULT_BASE + ROOT_RANGE - 1}) overlaps {clash}'s range in {path}",
                    hint=f"give root its own range: `usermod --add-subuids N-M --add-subgids N-M root` "
                         f"with {ROOT_RANGE} free ids")
    return IdMap(
        "root", ((0, ubase, ROOT_RANGE),), ((0, gbase, ROOT_RANGE),),
        reason=f"running as root: sandbox ids 0..{ROOT_RANGE - 1} are host ids {ubase}..{ubase + ROOT_RANGE - 1}, "
               f"from {where}; host root is not mapped")


def _overlapping_range(path: str, start: int, count: int) -> str | None:
    """The owner of an entry of `path` overlapping [start, start+count)."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.strip().split(":")
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                    s, c = int(parts[1]), int(parts[2])
                    if s < start + count and start < s + c:
                        return parts[0]
    except OSError:
        pass
    return None


def _mapped_ids(path: str) -> int:
    """How many ids from 0 up this process's user namespace maps without a gap."""
    try:
        with open(path) as f:
            lines = sorted(tuple(int(x) for x in line.split()) for line in f if line.strip())
    except (OSError, ValueError):
        return 1
    top = 0
    for inside, _, count in lines:
        if inside > top:
            break
        top = max(top, inside + count)
    return top


def _initial_user_namespace() -> bool:
    return _mapped_ids("/proc/self/uid_map") == 4294967295


def _namespace_root() -> IdMap:
    """uid 0 of a user namespace (a container's root, `unshare -r`): not
    host root, so its own ids map onto themselves, as many as it has."""
    n = min(_mapped_ids("/proc/self/uid_map"), _mapped_ids("/proc/self/gid_map"), ROOT_RANGE)
    lines = ((0, 0, n),)
    return IdMap("root", lines, lines,
                 reason=f"uid 0 of a user namespace (not host root): its ids 0..{n - 1} map onto themselves")


def _no_new_privs() -> bool:
    try:
        with open("/proc/self/status") as f:
            return any(line.split() == ["NoNewPrivs:", "1"] for line in f)
    except OSError:
        return False
