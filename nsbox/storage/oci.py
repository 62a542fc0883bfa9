"""OCI and Docker image formats: media types, digests, platforms, manifests."""

from __future__ import annotations

import hashlib
import json
import platform as _platform
import re
from dataclasses import dataclass
from typing import Any

from ..errors import NsboxError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT = ", ".join((OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST))
# Some media types say "no layer to unpack" (in-toto attestations, artifacts).
_SKIPPED_LAYER_TYPES = ("application/vnd.in-toto+json",)


class DigestMismatch(NsboxError):
    """Content that is not what its digest says."""


# An image names its blobs and layers by digest, and the store turns those
# into paths: only these exact forms may ever reach a path.
_DIGEST = re.compile(r"(sha256):([0-9a-f]{64})|(sha512):([0-9a-f]{128})")
# More layers than this fails overlay's mount anyway (and Docker's at 125).
MAX_LAYERS = 128
# What is read whole: a manifest or index, a config (podman's and skopeo's bounds).
MAX_MANIFEST = 4 << 20
MAX_CONFIG = 4 << 20


def check_digest(digest: object, what: str = "an image") -> tuple[str, str]:
    """(algorithm, hex) of a well-formed digest, else a one-line error."""
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        shown = repr(digest)[:100]
        raise NsboxError(f"invalid digest {shown} in {what}",
                         hint="the image is damaged or hostile; a digest is sha256: and 64 hex digits")
    return (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))


def json_doc(data: bytes, what: str, error: type[NsboxError] = NsboxError) -> Any:
    """`data` parsed as JSON, else `error` (json.loads recurses: a
    document nested 200k deep is a RecursionError, not a ValueError)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise error(f"{what} is not valid JSON (or nests too deeply)") from None


def json_object(data: bytes, what: str, error: type[NsboxError] = NsboxError) -> dict[str, Any]:
    """`data` as a JSON object (a manifest, an index, a config), else `error`."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise error(f"{what} is not a JSON object")
    return doc


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def hasher(digest: str) -> hashlib._Hash:
    return hashlib.new(check_digest(digest)[0])


def verify(data: bytes, digest: str, what: str) -> None:
    h = hasher(digest)
    h.update(data)
    if f"{digest.split(':')[0]}:{h.hexdigest()}" != digest:
        raise DigestMismatch(f"{what} does not match its digest {digest}",
                             hint="the source is damaged or tampered with; try again or use another source")


def media_type(doc: dict[str, Any], header: str | None = None) -> str:
    """A manifest's type: its own mediaType field, else the HTTP header, else by shape."""
    mt = doc.get("mediaType") or header or ""
    if mt in INDEX_TYPES or mt in MANIFEST_TYPES:
        return mt
    if "manifests" in doc:
        return OCI_INDEX
    if "layers" in doc and "config" in doc:
        return OCI_MANIFEST
    if doc.get("schemaVersion") == 1:
        raise NsboxError("this image uses Docker's schema 1 manifest, deprecated since 2017",
                         hint="push it again with a current Docker or skopeo")
    raise NsboxError(f"unsupported manifest type {mt or 'unknown'}")


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.strip().split("/")
        if len(parts) == 1:  # "arm64": the OS is linux
            parts = ["linux", *parts]
        if len(parts) not in (2, 3) or not all(parts):
            raise NsboxError(f"invalid platform {text!r}", hint="write OS/ARCH[/VARIANT], e.g. linux/arm64")
        arch, variant = _ARCH_ALIASES.get(parts[1], (parts[1], None))
        return cls(parts[0], arch, parts[2] if len(parts) == 3 else variant)

    @classmethod
    def current(cls) -> Platform:
        arch, variant = _ARCH_ALIASES.get(_platform.machine().lower(), (_platform.machine().lower(), None))
        return cls("linux", arch, variant)

    def matches(self, p: dict[str, Any]) -> bool:
        if p.get("os") != self.os or p.get("architecture") != self.architecture:
            return False
        # arm64 images often leave the variant out; v8 is the only one.
        want = self.variant or ""
        have = p.get("variant") or ""
        return not want or not have or want == have


# uname -m (or Go's name) -> (GOARCH, variant)
_ARCH_ALIASES: dict[str, tuple[str, str | None]] = {
    "x86_64": ("amd64", None), "amd64": ("amd64", None), "aarch64": ("arm64", None), "arm64": ("arm64", None),
    "armv7l": ("arm", "v7"), "armv6l": ("arm", "v6"), "i686": ("386", None), "i386": ("386", None),
    "ppc64le": ("ppc64le", None), "s390x": ("s390x", None), "riscv64": ("riscv64", None),
}


def select_manifest(index: dict[str, Any], want: Platform) -> dict[str, Any]:
    """The descriptor of an index's manifest for `want` (the first match)."""
    listed = index.get("manifests") or []
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        raise NsboxError("the image index's manifests are not a list of descriptors")
    candidates = [m for m in listed if m.get("mediaType", OCI_MANIFEST) not in INDEX_TYPES or "platform" in m]
    for desc in candidates:
        p = desc.get("platform")
        if isinstance(p, dict) and want.matches(p):
            return check_descriptor(desc, "the image index")
    offered = sorted({f"{p.get('os')}/{p.get('architecture')}" + (f"/{p['variant']}" if p.get('variant') else "")
                      for d in candidates if isinstance(p := d.get("platform"), dict) and p.get("os") != "unknown"})
    raise NsboxError(f"the image has no variant for {want} (it has: {', '.join(offered) or 'none'})",
                     hint="choose one with --platform")


def layer_descriptors(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The layers to unpack, each with a well-formed digest and size."""
    found = manifest.get("layers") or []
    if not isinstance(found, list) or not all(isinstance(d, dict) for d in found):
        raise NsboxError("the image manifest's layers are not a list of descriptors")
    layers = [d for d in found if d.get("mediaType") not in _SKIPPED_LAYER_TYPES]
    if len(layers) > MAX_LAYERS:
        raise NsboxError(f"the image has {len(layers)} layers, more than the {MAX_LAYERS} nsbox stacks")
    for d in layers:
        if "foreign" in (d.get("mediaType") or "") and d.get("urls"):
            raise NsboxError("this image has foreign layers (Windows base layers); nsbox runs Linux images only")
        check_descriptor(d, "the image manifest", sized=True)
    return layers


def check_descriptor(desc: object, what: str, sized: bool = False) -> dict[str, Any]:
    """A descriptor with a well-formed digest and a size that is a count;
    `sized`: one it must give (what is downloaded or copied stops at it)."""
    if not isinstance(desc, dict):
        raise NsboxError(f"{what} has a descriptor that is not an object")
    check_digest(desc.get("digest"), what)
    size = desc.get("size", None if sized else 0)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 50:
        given = "no size" if size is None else f"the size {str(size)[:40]!r}"
        raise NsboxError(f"{what} gives {desc['digest']} {given}")
    return desc


def manifest_doc(config: tuple[str, int], layers: list[tuple[str, int, str]]) -> bytes:
    """An OCI manifest for content assembled here (imports)."""
    doc = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config[0], "size": config[1]},
        "layers": [{"mediaType": mt, "digest": d, "size": s} for d, s, mt in layers],
    }
    return json.dumps(doc, indent=2).encode()


def config_doc(diff_ids: list[str], plat: Platform, extra: dict[str, Any] | None = None) -> bytes:
    """An OCI image config for a root filesystem imported without one."""
    doc: dict[str, Any] = {
        "architecture": plat.architecture, "os": plat.os,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], **(extra or {})},
    }
    if plat.variant:
        doc["variant"] = plat.variant
    return json.dumps(doc, indent=2).encode()
