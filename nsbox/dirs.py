"""Where nsbox keeps its state: XDG directories, checked before use.

- runtime: $XDG_RUNTIME_DIR/nsbox (registry of live sandboxes, sockets),
           else a private /dev/shm/nsbox-$UID (tmpfs), else $TMPDIR/nsbox-$UID
- data:    $XDG_DATA_HOME/nsbox (the sandboxes' writable layers)
- cache:   $XDG_CACHE_HOME/nsbox

$XDG_RUNTIME_DIR is often unset or wrong (root, SSH without systemd, su);
then a private directory of our own on /dev/shm or under the temporary
directory is used.
A directory that someone else owns, or that others can write to, is refused:
it would let them plant sockets or layers in a sandbox.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Callable

from .errors import NsboxError


_checked: dict[Path, Path] = {}
# Each directory as last found, by what it was found from (the environment
# variables it depends on): a sandbox's creation asks several times.
_found: dict[tuple[str | None, ...], Path] = {}


def _checked_private_dir(path: Path) -> Path:
    """Creates `path` (mode 0700) if needed and verifies it is ours alone.

    The check runs once per process and directory; later calls only make
    sure it still exists.
    """
    if path in _checked and os.path.isdir(path):
        return path
    _checked[path] = _check_private_dir(path)
    return path


def _found_dir(key: tuple[str | None, ...], find: Callable[[], Path]) -> Path:
    """find(), or what it found last time for the same key, if that still
    exists (whatever removed it may have left something else there)."""
    path = _found.get(key)
    if path is not None and os.path.isdir(path):
        return path
    _found[key] = path = find()
    return path


def _check_private_dir(path: Path) -> Path:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise NsboxError(f"cannot create the state directory {path}: {e.strerror}") from None
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise NsboxError(f"refusing to use {path}: it is not a directory (a symlink?)")
    if st.st_uid != uid:
        raise NsboxError(
            f"refusing to use {path}: it belongs to uid {st.st_uid}, not to you (uid {uid})",
            hint="remove it, or point NSBOX_STATE_DIR / XDG_RUNTIME_DIR elsewhere",
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
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


def runtime_dir() -> Path:
    """Registry and sockets of live sandboxes: small files, best on tmpfs."""
    env = os.environ
    return _found_dir(("run", env.get("NSBOX_STATE_DIR"), env.get("XDG_RUNTIME_DIR"), str(os.geteuid())),
                      _find_runtime_dir)


def _find_runtime_dir() -> Path:
    override = os.environ.get("NSBOX_STATE_DIR")
    if override:
        return _checked_private_dir(Path(override) / "run")
    base = _usable_runtime_base(os.environ.get("XDG_RUNTIME_DIR"))
    if base is not None:
        return _checked_private_dir(base / "nsbox")
    # /dev/shm is a tmpfs almost everywhere, and world-writable like /tmp.
    name = f"nsbox-{os.geteuid()}"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return _checked_private_dir(Path("/dev/shm") / name)
    return _checked_private_dir(Path(tempfile.gettempdir()) / name)


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
    env = os.environ

    def find() -> Path:
        override = env.get("NSBOX_STATE_DIR")
        if override:
            return _checked_private_dir(Path(override) / kind)
        return _checked_private_dir(_home_based(env_var, default) / "nsbox")

    return _found_dir((kind, env.get("NSBOX_STATE_DIR"), env.get(env_var), env.get("HOME")), find)
