"""The root filesystem of an image: nsbox.rootfs.ImageRootfs (re-exported)."""

from __future__ import annotations

from ..rootfs import ImageRootfs

__all__ = ["ImageRootfs"]
