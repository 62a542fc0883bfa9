"""The error of reading a compose file."""

from __future__ import annotations

from ..errors import NsboxError


class ComposeError(NsboxError):
    """A compose file nsbox cannot read, or asks for what nsbox cannot do.

    `issues` lists each problem ("service web: pid: host") when there are
    several; the message names them all.
    """

    def __init__(self, message: str, hint: str | None = None, issues: list[str] | None = None) -> None:
        super().__init__(message, hint)
        self.issues = list(issues or [message])
