"""The errors of `nsbox build`."""

from __future__ import annotations

from ..errors import NsboxError


class BuildError(NsboxError):
    """A Dockerfile that cannot be built: the message names the file and line."""

    def __init__(self, message: str, hint: str | None = None, *, where: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message, hint)
