"""Which pulls and imports under way use a store's layers.

Each holds a shared flock on locks/use-KEY-HEX.lock for every layer it
counted (found unpacked, or unpacked itself) until it ends, by which time
its image is named. A refused image takes back the layers it unpacked only
where it can take that lock exclusively: another image, which found one of
them unpacked, may be about to be named with it. (The live sandboxes that
stack layers: host/stacked.py.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import anyio


async def acquire(fd: int, op: int) -> None:
    """flock(fd, op), polled so that a waiting task can be cancelled."""
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.1)


class Counted:
    """The layers one pull or import counted: a shared lock on each, and
    which of its images (budgets) counted it."""

    def __init__(self, locks: Path) -> None:
        self.locks = locks
        self.held: dict[Path, tuple[int, set[int]]] = {}

    def _path(self, layer: Path) -> Path:
        return self.locks / f"use-{layer.parent.name}-{layer.name}.lock"

    async def hold(self, layer: Path, image: object) -> None:
        """Holds `layer` for `image`. Waits while a refusal elsewhere takes
        it back: the caller looks for the layer after this."""
        if layer not in self.held:
            fd = os.open(self._path(layer), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                await acquire(fd, fcntl.LOCK_SH)
            except BaseException:
                os.close(fd)
                raise
            if layer in self.held:  # another task of this session got there while we waited
                os.close(fd)
            else:
                self.held[layer] = (fd, set())
        self.held[layer][1].add(id(image))

    @contextlib.contextmanager
    def alone(self, layer: Path, image: object) -> Iterator[bool]:
        """Lets go of `image`'s hold on `layer`; True, and the layer held
        exclusively for the block, when no other image holds it, here or
        in another session."""
        fd, images = self.held.get(layer, (-1, set()))
        images.discard(id(image))
        if images:
            yield False
            return
        if fd >= 0:
            os.close(fd)
            del self.held[layer]
        fd = os.open(self._path(layer), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
            else:
                yield True
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd, _ in self.held.values():
            os.close(fd)
        self.held.clear()
