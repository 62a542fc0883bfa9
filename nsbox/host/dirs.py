"""Where nsbox keeps its state: XDG directories, checked before each use.

- runtime: $XDG_RUNTIME_DIR/nsbox (the live-sandbox list, sockets),
           else a private /dev/shm/nsbox-$UID (tmpfs), else $TMPDIR/nsbox-$UID
- data:    $XDG_DATA_HOME/nsbox (the sandboxes' writable layers)
- cache:   $XDG_CACHE_HOME/nsbox

$XDG_RUNTIME_DIR is often unset or wrong (root, SSH without systemd, su);
then a private directory of our own on /dev/shm or under the temporary
directory is used.

Whoever can rename an entry of a directory on the way to a state
directory can later swap it for one of theirs, and the sandboxes' layers,
sockets and images would then be kept where they can change them. So the
whole path is checked, not just its last directory: it is walked from /
with descriptors (openat with O_NOFOLLOW, through symlinks by hand), and
every directory and symlink on the way must belong to you or to root, and
no directory may be writable by others unless it is sticky (as /tmp is:
there only an entry's owner may rename it, and that owner is checked in
turn). The state directory itself must be yours, and is made mode 0700.
The check runs again whenever the last one is older than a second, so
that a long-lived process notices a directory removed (by a /tmp cleaner,
say) and made again by someone else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..errors import NsboxError

_MAX_SYMLINKS = 40  # as the kernel's path walk allows
_FIX = "point NSBOX_STATE_DIR at a directory of your own, e.g. `export NSBOX_STATE_DIR=$(mktemp -d)`"


def _refuse(path: Path, where: str, problem: str, hint: str) -> NsboxError:
    shown = f"{path}" if where == os.fspath(path) else f"{path}: {where}"
    return NsboxError(f"refusing to use the state directory {shown} {problem}", hint=hint)


def trusted_uids() -> set[int]:
    """You and root (see _unmapped_owner)."""
    uids = {0, os.geteuid()}
    unmapped = _unmapped_owner()
    if unmapped is not None:
        uids.add(unmapped)
    return uids


@functools.cache
def _unmapped_owner() -> int | None:
    """Inside a user namespace other than the host's, the host's root (and
    everyone else unmapped) shows as the overflow uid: it cannot be told
    apart from the others there, and is taken for root."""
    try:
        with open("/proc/self/uid_map") as f:
            if f.read().split() == ["0", "0", "4294967295"]:
                return None
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _check_step(path: Path, where: str, st: os.stat_result, trusted: set[int]) -> None:
    """A directory or symlink on the way to `path` (`where`) must not be
    replaceable by anyone but you and root."""
    if st.st_uid not in trusted:
        raise _refuse(path, where, f"belongs to uid {st.st_uid}, who could replace what is in it",
                      f"remove {where} if it is not yours to keep, or {_FIX}")
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        who = "others" if st.st_mode & 0o002 else f"group {st.st_gid}"
        raise _refuse(path, where, f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}, not sticky), who "
                      "could replace what is in it", f"`chmod go-w {where}`, or {_FIX}")


def _open_private_dir(path: Path) -> int:
    """Walks `path` from /, creating what is missing (mode 0700), checks
    every step (see above) and returns a descriptor of the last one, which
    is yours and mode 0700."""
    uid, trusted = os.geteuid(), trusted_uids()
    todo = list(reversed(os.fspath(path).split("/")))
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    stack = [(root, "/")]  # the directories walked, for ".."
    links = 0
    try:
        _check_step(path, "/", os.fstat(root), trusted)
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            parent, parent_path = stack[-1]
            where = os.path.join(parent_path, name)
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    pass  # made meanwhile: checked like any other
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                os.close(fd)
                _check_step(path, where, st, trusted)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise _refuse(path, where, "goes through too many symlinks", _FIX)
                target = os.readlink(name, dir_fd=parent)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                todo.extend(reversed(target.split("/")))
                continue
            stack.append((fd, where))
            if not stat.S_ISDIR(st.st_mode):
                raise _refuse(path, where, "is not a directory", _FIX)
            _check_step(path, where, st, trusted)
        fd, where = stack[-1]
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise _refuse(path, where, f"belongs to uid {st.st_uid}, not to you (uid {uid})",
                          f"remove it, or {_FIX}")
        leaf = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        if st.st_mode & 0o077:
            os.fchmod(leaf, 0o700)
        return leaf
    except OSError as e:
        raise NsboxError(f"cannot create the state directory {path}: {e.strerror}") from None
    finally:
        for fd, _ in stack:
            os.close(fd)


# When each path last passed the walk above. Once it has, only you or root
# can change what it checks, so a sandbox's create (which asks for several
# state directories) need not walk again; a path is walked again once its
# check is older than this, so that a directory removed and made anew by
# someone else is still noticed by a long-running process.
_RECHECK_AFTER = 1.0
_checked_at: dict[Path, float] = {}


def _checked_private_dir(path: Path) -> Path:
    """`path`, made if needed and checked (see above)."""
    path = Path(os.path.abspath(path))
    now = time.monotonic()
    if now - _checked_at.get(path, -_RECHECK_AFTER) < _RECHECK_AFTER:
        return path
    os.close(_open_private_dir(path))
    _checked_at[path] = now
    return path


def _usable_runtime_base(value: str | None) -> Path | None:
    if not value or not os.path.isabs(value):
        return None
    try:
        st = os.stat(value)
    except OSError:
        return None
    # A stale value (after su, say) names someone else's directory.
    if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077:
        return None
    return Path(value)


def _state_dir() -> Path | None:
    """NSBOX_STATE_DIR, when set. Absolute only: a relative one would name
    another directory in each working directory (the `nsbox shell` line the
    provider prints, say, would not reach the sandbox)."""
    value = os.environ.get("NSBOX_STATE_DIR")
    if not value:
        return None
    if not os.path.isabs(value):
        raise NsboxError(f"NSBOX_STATE_DIR must be an absolute path, not {value!r}", hint=_FIX)
    return Path(value)


# Each state directory as last chosen and checked, by what chose it (the
# environment's values): a sandbox's create asks for them several times,
# and choosing costs path arithmetic and a stat. Chosen again, and walked,
# once the answer is older than _RECHECK_AFTER, like any check.
_chosen: dict[tuple[str | int | None, ...], tuple[Path, float]] = {}


def _chosen_dir(kind: str, env_vars: tuple[str, ...], choose: Callable[[], Path]) -> Path:
    """`choose()`'s directory, made and checked, or the same answer given
    less than _RECHECK_AFTER ago for the same environment."""
    env = os.environ
    key = (kind, os.geteuid(), env.get("NSBOX_STATE_DIR"), *(env.get(v) for v in env_vars))
    now = time.monotonic()
    hit = _chosen.get(key)
    if hit is not None and now - hit[1] < _RECHECK_AFTER:
        return hit[0]
    path = _checked_private_dir(choose())
    # As old as the walk it relies on, which another key may have made.
    _chosen[key] = (path, _checked_at.get(path, now))
    return path


def runtime_dir() -> Path:
    """The live-sandbox list and the sandboxes' sockets: small files, best on tmpfs."""
    return _chosen_dir("run", ("XDG_RUNTIME_DIR", "TMPDIR"), _choose_runtime_dir)


def _choose_runtime_dir() -> Path:
    override = _state_dir()
    if override:
        return override / "run"
    base = _usable_runtime_base(os.environ.get("XDG_RUNTIME_DIR"))
    if base is not None:
        return base / "nsbox"
    # /dev/shm is a tmpfs almost everywhere, and world-writable like /tmp.
    name = f"nsbox-{os.geteuid()}"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return Path("/dev/shm") / name
    return Path(tempfile.gettempdir()) / name


def _home_based(env: str, default: str) -> Path:
    value = os.environ.get(env)
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / default


def data_dir() -> Path:
    """Writable layers of sandboxes."""
    return _xdg_dir("data", "XDG_DATA_HOME", ".local/share")


def cache_dir() -> Path:
    return _xdg_dir("cache", "XDG_CACHE_HOME", ".cache")


def _xdg_dir(kind: str, env_var: str, default: str) -> Path:
    def choose() -> Path:
        override = _state_dir()
        return override / kind if override else _home_based(env_var, default) / "nsbox"

    return _chosen_dir(kind, (env_var, "HOME"), choose)


PARTIAL = ".tmp"
# write_whole's temporary file lives for microseconds: one this old (in
# seconds) was left by a process killed while writing.
PARTIAL_STALE_S = 60


def write_whole(path: str, data: bytes) -> None:
    """Writes a state file so that a reader finds the old one or the new one,
    never a part: into PATH.tmp beside it, then renamed over it."""
    tmp = path + PARTIAL
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_stale_partial(path: str) -> None:
    """Removes write_whole's temporary file `path` if its writer was killed
    (see PARTIAL_STALE_S); one being written is left alone."""
    with contextlib.suppress(OSError):
        if time.time() - os.lstat(path).st_mtime > PARTIAL_STALE_S:
            os.unlink(path)
