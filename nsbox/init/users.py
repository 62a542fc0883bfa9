"""Users inside a sandbox, looked up in the sandbox's own /etc/passwd."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, primary gid first
    home: str
    shell: str = "/bin/sh"


ROOT = Identity("root", 0, 0, (0,), "/root")


def _rows(text: str, fields: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) >= fields:
            rows.append(parts)
    return rows


@functools.lru_cache(maxsize=256)  # a pure function of its texts; Identity is frozen
def lookup(user: str, passwd: str, group: str) -> Identity | None:
    """Resolves a user name or numeric uid, optionally with ":GROUP" (a
    name or gid, as Docker's USER takes it); None if a name is unknown.

    A numeric uid without a passwd entry is allowed, as with docker exec:
    it runs with gid 0 and HOME=/.
    """
    if ":" in user:
        user, _, grp = user.partition(":")
        base = lookup(user, passwd, group)
        gid = _group_id(grp, group)
        if base is None or gid is None:
            return None
        return Identity(base.name, base.uid, gid, (gid,), base.home, base.shell)
    entry = None
    for row in _rows(passwd, 7):
        if (user.isdigit() and row[2] == user) or row[0] == user:
            entry = row
            break
    if entry is None:
        if user.isdigit():
            return Identity(user, int(user), 0, (0,), "/")
        return None
    try:
        name, uid, gid, home, shell = entry[0], int(entry[2]), int(entry[3]), entry[5] or "/", entry[6] or "/bin/sh"
    except ValueError:
        return None
    groups = [gid]
    for row in _rows(group, 4):
        members = row[3].split(",") if row[3] else []
        if name in members:
            try:
                g = int(row[2])
            except ValueError:
                continue
            if g not in groups:
                groups.append(g)
    return Identity(name, uid, gid, tuple(groups), home, shell)


def _group_id(name: str, group: str) -> int | None:
    if name.isdigit():
        return int(name)
    for row in _rows(group, 4):
        if row[0] == name:
            try:
                return int(row[2])
            except ValueError:
                return None
    return None
