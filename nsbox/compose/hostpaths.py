"""Which host paths a compose file may name, and how nsbox opens them.

A compose file names host paths: `.env`, `env_file`, build contexts and
Dockerfiles, bind sources, `secrets` and `configs` files. nsbox reads or
mounts them with its own rights (real root's, as root), so a file from an
eval suite could hand a sandbox what the sandbox itself may not read: root's
~/.aws/credentials through an env_file, /root or the Docker socket through a
bind, your ~/.ssh in any mode. Each such path must therefore lie in the
project directory (the compose file's) once every symlink is resolved, or in
a directory that NSBOX_COMPOSE_PATHS names (os.pathsep-separated, read from
nsbox's own environment, never from a `.env`). The same holds in every
identity mode.

A path is checked resolved, then opened one component at a time without
following symlinks: the resolved path has none, so one appearing since means
the tree changed under us, and the open fails instead of leaving the tree.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ComposeError

ENV = "NSBOX_COMPOSE_PATHS"
MAX_FILE = 1 << 20  # .env and env_file: compose's are a few lines


class HostPaths:
    """The directories a project's compose file may name paths in: the
    project directory first, then those of NSBOX_COMPOSE_PATHS."""

    def __init__(self, directory: Path, extra: str | None = None) -> None:
        self.directory = os.path.realpath(directory)
        if extra is None:
            extra = os.environ.get(ENV, "")
        roots = [self.directory]
        for entry in filter(None, extra.split(os.pathsep)):
            if not os.path.isabs(entry):
                raise ComposeError(f"{ENV}: {entry!r} is not an absolute path")
            roots.append(os.path.realpath(entry))
        self.roots = tuple(dict.fromkeys(roots))

    def widened(self, *directories: str | os.PathLike[str]) -> "HostPaths":
        """This policy with `directories` allowed too (same project directory)."""
        extra = [*self.roots[1:], *(os.path.realpath(d) for d in directories)]
        return HostPaths(Path(self.directory), extra=os.pathsep.join(extra))

    def check(self, path: str | os.PathLike[str], what: str) -> str:
        """`path` with every symlink resolved, if that lies in an allowed
        directory; else a ComposeError naming `what` and the opt-in."""
        if "\0" in os.fspath(path):
            raise ComposeError(f"{what} {os.fspath(path)!r} holds a NUL character")
        real = os.path.realpath(path)
        if any(real == root or real.startswith(root.rstrip("/") + "/") for root in self.roots):
            return real
        shown = f"{path} (which resolves to {real})" if real != os.path.normpath(path) else str(path)
        raise ComposeError(
            f"{what} {shown} is outside the project directory {self.directory}",
            hint=f"a compose file may name host paths in its own directory only; to allow another, "
                 f"set {ENV}=DIR (see README \"Compose support\")")

    def read_text(self, path: str | os.PathLike[str], what: str, limit: int = MAX_FILE) -> str | None:
        """The text of a regular file in an allowed directory, at most
        `limit` bytes; None if there is no such file."""
        real = self.check(path, what)
        try:
            fd = open_resolved(real, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the reader
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ComposeError(f"cannot read {what} {path}: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ComposeError(f"{what} {path} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ComposeError(f"{what} {path} is larger than {limit // 1024} KiB")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ComposeError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None

    def make_dirs(self, path: str, what: str) -> str:
        """Creates the missing directories of `path` (in an allowed directory)
        without following a symlink; returns it resolved."""
        real = self.check(path, what)
        root = next(r for r in self.roots if real == r or real.startswith(r.rstrip("/") + "/"))
        fd = open_resolved(root, os.O_PATH | os.O_DIRECTORY)
        try:
            for part in filter(None, real[len(root):].split("/")):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except OSError as e:
            raise ComposeError(f"cannot create {what} {path}: {e.strerror}") from None
        finally:
            os.close(fd)
        return real


def open_resolved(real: str, flags: int) -> int:
    """Opens the absolute, symlink-free path `real` with `flags`, following
    no symlink on the way (ELOOP or ENOTDIR if one appeared)."""
    parts = [p for p in real.split("/") if p]
    if not parts:
        return os.open("/", flags | os.O_CLOEXEC)
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            step = flags if last else os.O_PATH | os.O_DIRECTORY
            nxt = os.open(part, step | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd
