"""Exceptions nsbox raises, and the notes and warnings it prints once.

They do not depend on Inspect; the Inspect provider translates them into
Inspect's own exception types.
"""

from __future__ import annotations

import sys


class NsboxError(Exception):
    """Base class for nsbox errors that are meant to be shown to a person.

    The message says what failed and why; `hint`, when set, says what to do.
    Both go on one line.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message + (f"; to fix: {hint}" if hint else ""))


class HostPrerequisiteError(NsboxError):
    """This host cannot run sandboxes (user namespaces blocked, kernel too old...)."""


class SandboxSetupError(NsboxError):
    """Creating the sandbox failed."""


class ResourceExhausted(SandboxSetupError):
    """Creating the sandbox ran into a limit of this process, user or host
    (descriptors, processes, namespaces, memory, disk): `limit` names it
    (e.g. "RLIMIT_NOFILE", "user.max_user_namespaces"); the hint says how
    to raise it. Nothing of the sandbox is left behind."""

    def __init__(self, message: str, hint: str | None = None, limit: str = "") -> None:
        super().__init__(message, hint)
        self.limit = limit


class SandboxUnavailable(NsboxError):
    """The sandbox is not running (closed, or its init died)."""


class UserUnsupported(NsboxError):
    """The sandbox's id mapping cannot run this user."""


class OutputLimitExceeded(NsboxError):
    """A command's output stream or a file was larger than the limit.

    For exec, `stdout` and `stderr` hold the last `limit` bytes of each stream.
    """

    def __init__(self, message: str, limit: int, stdout: str | None = None, stderr: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.stdout = stdout
        self.stderr = stderr


class CommandTimeout(TimeoutError):
    """A command ran past its timeout and was killed with its process tree.

    `stdout` and `stderr` hold what it wrote before that.
    """

    def __init__(self, message: str, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr

    @property
    def truncated_output(self) -> str:
        return self.stdout + self.stderr


# What note_once and warn_once have printed in this process.
_said: set[str] = set()


def note_once(text: str) -> None:
    """Says something a person should know, once per process."""
    _say_once(f"nsbox: note: {text}")


def warn_once(text: str) -> None:
    """Says what is not enforced or was left behind, once per process."""
    _say_once(f"nsbox: warning: {text}")


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


def describe(e: BaseException) -> str:
    """An error in one line, for a person."""
    if isinstance(e, NsboxError):
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename is not None else e.strerror
    return f"{type(e).__name__}: {e}"
