"""Deleting sandbox layers: directory trees whose contents a sandbox chose.

A sandbox decides what its writable layer holds: trees deeper than Python's
recursion limit, paths longer than PATH_MAX, directories it made unreadable,
symlinks to anywhere on the host. So a tree is deleted by an iterative walk
through directory descriptors: names are looked up one component at a time
relative to an open directory, symlinks are never followed, only the
current directory is open (the depth may exceed the descriptor limit), and
every step back up through ".." is checked to land in the directory the
walk came from.
"""

from __future__ import annotations

import atexit
import errno
import os
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import NsboxError

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RemovalError(NsboxError):
    """A layer could not be deleted, for a reason other than a plain OSError."""


@dataclass
class _Level:
    """A directory on the walk's path from the top of the tree."""

    name: str  # its name in its parent
    ident: tuple[int, int]  # (st_dev, st_ino), to recognize it on the way back up
    subdirs: list[str] = field(default_factory=list)  # still to delete


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Deletes `path` and everything below it, of any depth, without
    following a symlink. Directories of ours without read, write or search
    permission are granted it first (overlayfs leaves a mode-000 work dir).

    Raises PermissionError when files owned by other users remain (sandbox
    users other than root, in subuid mode): remove_layer()
    (nsbox/create/unshare.py) then deletes them from inside a user
    namespace. A missing `path` is not an error.
    """
    parent, name = os.path.split(os.path.abspath(path))
    if not name:
        raise RemovalError(f"refusing to remove {path!r}")
    # The path leading to the tree is ours; only what is inside the tree is not.
    try:
        top = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.lstat(name, dir_fd=top)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            _remove_dir(top, name)
        else:
            os.unlink(name, dir_fd=top)
    finally:
        os.close(top)


def _remove_dir(top: int, name: str) -> None:
    """Deletes the directory `name` of the open directory `top`."""
    top_ident = _ident(os.fstat(top))
    levels: list[_Level] = []
    fd = -1
    try:
        fd, st = _open_dir(top, name)
        levels.append(_Level(name, _ident(st), _unlink_files(fd)))
        while levels:
            level = levels[-1]
            if level.subdirs:
                child = level.subdirs.pop()
                try:
                    sub, st = _open_dir(fd, child)
                except FileNotFoundError:
                    continue
                os.close(fd)
                fd = sub
                levels.append(_Level(child, _ident(st)))
                levels[-1].subdirs = _unlink_files(fd)
                continue
            # Empty now: go back up. Its parent may have been moved meanwhile
            # (by a process of the sandbox still running): never leave the tree.
            levels.pop()
            up = os.open("..", _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = up
            if _ident(os.fstat(fd)) != (levels[-1].ident if levels else top_ident):
                raise RemovalError(f"{_where(levels, level.name)} was moved while it was being deleted; stopped")
            os.rmdir(level.name, dir_fd=fd)
    except OSError as e:
        if e.errno is None or not isinstance(e.filename, str):
            raise
        # Name the entry by its path in the tree, not by its bare name.
        raise OSError(e.errno, e.strerror, _where(levels, e.filename)) from None
    finally:
        if fd >= 0:
            os.close(fd)


def _open_dir(parent: int, name: str) -> tuple[int, os.stat_result]:
    """Opens the directory `name` of `parent` (not a symlink), making sure we
    may list it and delete its entries when it is ours."""
    try:
        fd = os.open(name, _OPEN_DIR, dir_fd=parent)
    except PermissionError:
        fd = _grant_and_open(parent, name)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_mode & 0o700 != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _grant_and_open(parent: int, name: str) -> int:
    """Opens a directory we may not read or search, after granting ourselves
    that if it is ours; re-raises PermissionError if it is not."""
    pfd = grant(name, parent)
    try:
        return os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(pfd)


def grant(name: str | os.PathLike[str], parent: int | None = None) -> int:
    """Gives us (mode 700) the directory `name` of `parent` if it is ours,
    never a symlink's target; returns an O_PATH descriptor of it. Raises
    PermissionError if it is not ours."""
    pfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        if os.fstat(pfd).st_uid != os.geteuid():
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(name))
        # fchmod refuses an O_PATH descriptor; its /proc link reaches the
        # very inode it pins, with no lookup a symlink could redirect.
        os.chmod(f"/proc/self/fd/{pfd}", 0o700)
    except BaseException:
        os.close(pfd)
        raise
    return pfd


def _unlink_files(fd: int) -> list[str]:
    """Deletes every entry of the open directory `fd` that is not a
    directory (symlinks included, never their targets); returns the names
    of its subdirectories."""
    subdirs = []
    with os.scandir(fd) as entries:  # scandir works on a duplicate of fd
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    return subdirs


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _where(levels: list[_Level], name: str) -> str:
    """The path of `name` below the current level, shortened to fit a line."""
    path = "/".join([level.name for level in levels] + [name])
    return path if len(path) <= 200 else f"{path[:80]}/.../{path[-100:]}"


# How long a process waits for its sweeper when it exits, or before gc.
SWEEP_WAIT = 120.0


class _Sweeper:
    """Releases the layers of closed sandboxes (`later`: see
    Sandbox._teardown), ends those closed without waiting (see
    procedure.teardown) and empties trash directories (see
    layers.set_aside_work) on a thread of its own. Each directory made or
    removed costs a journal transaction, on a disk mounted with `discard` a
    discard as well, and no sandbox needs to wait for that. A process
    finishes its releases when it exits (at most SWEEP_WAIT s); whatever it
    leaves is swept by the next one, or by `nsbox gc`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._dirs: set[str] = set()
        self._jobs: list[Callable[[], None]] = []
        self._firsts: list[Callable[[], None]] = []  # queued `first`: run before any of _jobs
        self._thread: threading.Thread | None = None
        self._at_exit = False

    def poke(self, trash: Path) -> None:
        with self._lock:
            self._dirs.add(os.fspath(trash))
            self._start()

    def later(self, job: Callable[[], None], first: bool = False) -> None:
        """Runs `job` on the thread, in order, or with `first` before every
        job queued without it (a sandbox's end need not wait behind the
        deletion of another's large layer); it reports its own failures."""
        with self._lock:
            (self._firsts if first else self._jobs).append(job)
            self._start()
            if not self._at_exit:
                self._at_exit = True
                atexit.register(self._finish)

    def _start(self) -> None:
        self._idle.clear()
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():  # or forked since
            self._thread = threading.Thread(target=self._run, name="nsbox-sweeper", daemon=True)
            self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Whether everything poked or queued so far is done within `timeout` s."""
        return self._idle.wait(timeout)

    def _finish(self) -> None:
        if not self.wait(SWEEP_WAIT):
            print(f"nsbox: the layers of closed sandboxes were still being deleted after {SWEEP_WAIT:.0f}s; "
                  "`nsbox gc` deletes what is left", file=sys.stderr)

    def _after_fork(self) -> None:
        """In a forked child: the parent's work is the parent's."""
        self._lock = threading.Lock()
        self._jobs.clear()
        self._firsts.clear()
        self._dirs.clear()
        self._wake.clear()
        self._idle.set()
        self._thread = None

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    queue = self._firsts or self._jobs
                    if not queue:
                        break
                    job = queue.pop(0)
                try:
                    job()
                except Exception as e:  # a job reports its own failures; this one did not
                    print(f"nsbox: releasing a closed sandbox's layer failed: {e!r}", file=sys.stderr)
            with self._lock:
                dirs = list(self._dirs)
            for trash in dirs:
                sweep(trash)
            with self._lock:
                if not self._wake.is_set():
                    self._idle.set()


def sweep(trash: str | os.PathLike[str]) -> None:
    """Deletes what is in `trash`, best effort: another process may be
    sweeping it too, and what fails now is tried again next time."""
    try:
        names = os.listdir(trash)
    except OSError:
        return
    for name in names:
        try:
            remove_tree(os.path.join(trash, name))
        except (OSError, RemovalError):
            pass


_sweeper = _Sweeper()
os.register_at_fork(after_in_child=_sweeper._after_fork)
sweep_later = _sweeper.poke
release_later = _sweeper.later
wait_swept = _sweeper.wait
