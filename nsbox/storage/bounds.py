"""Bounds on what unpacking an image may write: bytes and files, per layer
and per image.

A layer is a compressed tar, and gzip alone expands zeros about 1000:1, so
a small blob could otherwise fill the host's disk. The bytes counted are
those of the uncompressed tar stream (a sparse file's holes are neither in
it nor on disk); the files are the entries created, directories made for a
member's parents included. `NSBOX_IMAGE_LIMITS` raises or lowers them:
`layer-size=40G,size=100G,layer-files=2M,files=8M`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..errors import NsboxError

ENV = "NSBOX_IMAGE_LIMITS"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_COUNTS = {"": 1, "k": 1000, "m": 1000_000}


class TooLarge(NsboxError):
    """A layer or image over a bound of `ImageBounds`."""


@dataclass(frozen=True)
class ImageBounds:
    layer_size: int = 16 << 30
    layer_files: int = 1_000_000
    size: int = 64 << 30
    files: int = 4_000_000

    @classmethod
    def from_env(cls) -> ImageBounds:
        lim = cls()
        text = os.environ.get(ENV, "").strip()
        names = {f.name.replace("_", "-"): f.name for f in fields(cls)}
        for item in filter(None, (i.strip() for i in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            m = re.fullmatch(r"(\d+)\s*([a-z]?)i?b?", value.strip().lower())
            units = _UNITS if key.endswith("size") else _COUNTS
            if not sep or key not in names or not m or m.group(2) not in units:
                raise NsboxError(f"{ENV}: cannot read {item!r}",
                                 hint="write e.g. layer-size=40G,size=100G,layer-files=2M,files=8M")
            lim = replace(lim, **{names[key]: int(m.group(1)) * units[m.group(2)]})
        return lim


def bytes_text(n: int) -> str:
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{n} bytes"


def refusal(what: str, key: str, limit: int) -> TooLarge:
    amount = bytes_text(limit) if key.endswith("size") else f"{limit} files"
    return TooLarge(f"{what} unpacks to more than {amount}; nothing of it was kept",
                    hint=f"if the image is trusted, raise the bound: {ENV}={key}=N (see README, Images)")


class Budget:
    """One image's share of the bounds while its layers unpack (side by
    side): each layer may use the rest of the image's bound, and what the
    layers used is summed when each is done, so concurrent layers can
    overshoot only until the sum is checked."""

    def __init__(self, what: str, bounds: ImageBounds | None = None) -> None:
        self.what = what
        self.bounds = bounds or ImageBounds.from_env()
        self.size = 0
        self.files = 0
        self.published: list[Path] = []  # layers unpacked for it by this pull or import
        self.refused: TooLarge | None = None  # once refused, no layer of it is put in place

    def for_layer(self) -> tuple[int, int]:
        """(bytes, files) the next layer may unpack to."""
        lim = self.bounds
        return min(lim.layer_size, lim.size - self.size), min(lim.layer_files, lim.files - self.files)

    def refusal(self, layer: str, kind: str, allowed: tuple[int, int]) -> TooLarge:
        """The error for a layer stopped at `allowed` (from for_layer)."""
        lim = self.bounds
        if kind == "size":
            if allowed[0] < lim.layer_size:
                return refusal(f"image {self.what}", "size", lim.size)
            return refusal(f"layer {layer}", "layer-size", lim.layer_size)
        if allowed[1] < lim.layer_files:
            return refusal(f"image {self.what}", "files", lim.files)
        return refusal(f"layer {layer}", "layer-files", lim.layer_files)

    def add(self, size: int, files: int) -> TooLarge | None:
        """Counts a layer in; the error if the image is now over a bound."""
        self.size += size
        self.files += files
        if self.size > self.bounds.size:
            return refusal(f"image {self.what}", "size", self.bounds.size)
        if self.files > self.bounds.files:
            return refusal(f"image {self.what}", "files", self.bounds.files)
        return None
