"""Image references, normalised as Docker does.

`python:3.12` is `docker.io/library/python:3.12`; `ghcr.io/o/r@sha256:...`
keeps its digest; a name without tag or digest gets `:latest`. The first
component is a registry only if it has a dot or a colon, or is
`localhost` (Docker's rule), so `user/app` is on Docker Hub.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ..errors import NsboxError

DOCKER_HUB = "docker.io"
# Docker Hub's API endpoint (docker.io itself serves the web site).
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io"}

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128}")
_DOMAIN = re.compile(r"(?:[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?")


class ReferenceError(NsboxError):
    """A string that is not a valid image reference."""


@dataclass(frozen=True)
class Reference:
    registry: str  # "docker.io", "ghcr.io", "127.0.0.1:5000"
    repository: str  # "library/python"
    tag: str | None  # None when only a digest was given
    digest: str | None  # "sha256:..."

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s

    @property
    def name(self) -> str:
        """registry/repository, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def reference(self) -> str:
        """What the registry's manifest endpoint takes: the digest if any, else the tag."""
        return self.digest or self.tag or "latest"

    def short(self) -> str:
        """As Docker prints it: without docker.io/library/."""
        s = str(self)
        for prefix in (f"{DOCKER_HUB}/library/", f"{DOCKER_HUB}/"):
            if s.startswith(prefix):
                return s[len(prefix):]
        return s

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)


def parse(text: str) -> Reference:
    """Normalises `text` as `docker pull` does, or raises ReferenceError."""
    original = text
    if not text or text != text.strip():
        raise ReferenceError(f"invalid image reference {original!r}: empty or surrounded by spaces")
    digest = None
    if "@" in text:
        text, digest = text.rsplit("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise ReferenceError(f"invalid image reference {original!r}: bad digest {digest!r}",
                                 hint="a digest is sha256: followed by 64 lowercase hex digits")
    tag = None
    slash, colon = text.rfind("/"), text.rfind(":")
    if colon > slash:
        text, tag = text[:colon], text[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise ReferenceError(f"invalid image reference {original!r}: bad tag {tag!r}")
    first, sep, rest = text.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        if not _DOMAIN.fullmatch(first):
            raise ReferenceError(f"invalid image reference {original!r}: bad registry {first!r}")
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, text
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in path:
            path = f"library/{path}"
    for component in path.split("/"):
        if not _COMPONENT.fullmatch(component):
            hint = "repository names are lowercase" if component.lower() != component else None
            raise ReferenceError(f"invalid image reference {original!r}: bad name component {component!r}",
                                 hint=hint)
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)


def is_loopback(registry: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (with or without a port): plain HTTP, as Docker does."""
    host = registry
    if host.startswith("["):
        host = host[1:host.index("]")]
    elif host.count(":") == 1:
        host = host.split(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
